"""Request models of /v1/load_lora_adapter and /v1/unload_lora_adapter (as in vLLM 0.33)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None
