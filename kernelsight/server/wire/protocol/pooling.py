"""Pooling requests as vLLM 0.33 takes them for an embedding model: /v1/embeddings, /pooling, /score (its four
spellings of the two sides) and /rerank."""

from __future__ import annotations

from typing import Any, Literal

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


class CohereEmbedRequest(BaseModel):
    """Cohere's /v2/embed request as vLLM takes it (texts, or ``inputs`` of text content)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input_type: str | None = None
    texts: list[str] | None = None
    inputs: list[dict[str, Any]] | None = None
    output_dimension: int | None = None
    embedding_types: list[Literal["float", "binary", "ubinary", "base64"]] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: int = 0

    def all_texts(self) -> list[str]:
        if self.texts is not None:
            return list(self.texts)
        return ["".join(str(c.get("text") or "") for c in (i.get("content") or []) if isinstance(c, dict))
                for i in self.inputs or []]
