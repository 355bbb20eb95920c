"""Pooling requests as vLLM 0.33 takes them for an embedding model: /v1/embeddings, /pooling, /score (its four
spellings of the two sides) and /rerank."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

PoolingInput = str | list[str] | list[int] | list[list[int]]
ScoreInputs = str | list[str]


class _PoolingBase(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    priority: int = 0
    add_special_tokens: bool = True
    user: str | None = None


class EmbeddingRequest(_PoolingBase):
    input: PoolingInput | None = None
    messages: list[dict[str, Any]] | None = None       # vLLM's chat-style embedding request
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    pass


class ScoreRequest(_PoolingBase):
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None

    def sides(self) -> tuple[ScoreInputs, ScoreInputs] | None:
        for a, b in ((self.queries, self.documents), (self.queries, self.items), (self.data_1, self.data_2),
                     (self.text_1, self.text_2)):
            if a is not None and b is not None:
                return a, b
        return None


class RerankRequest(_PoolingBase):
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int = 0
