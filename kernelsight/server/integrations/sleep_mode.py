"""Sleep mode's state (vLLM's dev-mode ``/sleep``, ``/wake_up``, ``/is_sleeping``): which memory tags are asleep
and at what level, and the ``vllm:engine_sleep_state`` label that goes with it.

Level 1 offloads the weights to host memory, level 2 discards them; both discard the KV cache (vLLM resets the
prefix cache on every sleep), and level 0 only pauses scheduling. A sleeping server takes no new generation
requests (503); /wake_up wakes the given tags (``weights``, ``kv_cache``; none given: all) and serving resumes
once none is asleep.

Timing (simulated, kept simple): offloading or restoring the weights is one copy of a rank's weight bytes over its
PCIe link (the ranks copy in parallel); discarding them (level 2) and the KV cache's reallocation cost nothing.
Waking weights a level-2 sleep discarded is priced as the same copy (vLLM expects the caller to reload them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kernelsight.simcore.engine_config import EngineConfig

SLEEP_TAGS = ("weights", "kv_cache")
SLEEPING_MESSAGE = "The model is sleeping. Wake it up with POST /wake_up before sending requests."


def weight_copy_s(config: EngineConfig) -> float:
    """Simulated seconds to move one rank's weights between device and host memory over PCIe."""
    return config.memory.weight_bytes / config.hardware.pcie_bytes_per_s


def sleep_copy_s(config: EngineConfig, level: int) -> float:
    """Simulated seconds /sleep takes: level 1 copies the weights to the host; 0 and 2 move nothing."""
    return weight_copy_s(config) if level == 1 else 0.0


def wake_copy_s(config: EngineConfig, mode: SleepMode, tags: list[str] | None) -> float:
    """Simulated seconds /wake_up ``tags`` takes: the weights' copy back when they are asleep and woken now."""
    waking = set(tags if tags is not None else SLEEP_TAGS)
    return weight_copy_s(config) if "weights" in waking & mode.sleeping_tags and mode.level > 0 else 0.0


@dataclass
class SleepMode:
    """What sleeps now: ``sleeping_tags`` empty means awake."""

    level: int = 0
    sleeping_tags: set[str] = field(default_factory=set)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int) -> None:
        self.level = level
        self.sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None) -> None:
        """Wake ``tags`` (all when None); ValueError on a tag that is not one of SLEEP_TAGS (nothing changes)."""
        bad = [t for t in tags or () if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"Unknown sleep tags {bad}; expected any of {list(SLEEP_TAGS)}.")
        self.sleeping_tags -= set(tags if tags is not None else SLEEP_TAGS)

    @property
    def metric_state(self) -> str:
        """The ``sleep_state`` label of ``vllm:engine_sleep_state`` (level 0 frees nothing: still ``awake``)."""
        if not self.is_sleeping or self.level == 0:
            return "awake"
        return "weights_offloaded" if self.level == 1 else "discard_all"
