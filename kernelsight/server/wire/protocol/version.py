"""The vLLM release this server speaks, and that release's request limits (vLLM reads them from the environment;
these are its defaults)."""

VLLM_VERSION = "0.33.0"
MAX_COMPLETION_PROMPTS = 1024     # VLLM_MAX_COMPLETION_PROMPTS
MAX_STOP_STRINGS = 4              # VLLM_MAX_STOP_STRINGS (0.33)
