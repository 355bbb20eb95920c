"""Llama 4 images: tiles of ``tile_px`` (336) on the best-fit canvas, plus a global thumbnail tile when there is
more than one; each tile is (tile/patch)^2 = 576 patches, pixel-shuffled 0.5 into 144 language-model tokens.

The rules are HF transformers' ``Llama4ImageProcessorFast`` and ``Llama4Processor._prompt_split_image``, which vLLM
runs for Llama 4:
- the canvases are every (rows, cols) of tiles with rows*cols <= max_patches (16), in pixels;
- each canvas's scale is min(canvas_h / h, canvas_w / w); the smallest scale >= 1 is chosen (no upscaling past it;
  ``resize_to_max_canvas`` takes the largest), else the largest scale < 1; ties go to the smallest canvas area;
- the prompt gets ``<|image_start|>``, then, with more than one tile, each row's tiles of ``<|patch|>`` x 144
  separated by ``<|tile_x_separator|>`` and ended by ``<|tile_y_separator|>``, then ``<|image|>`` and the global
  tile's 144 ``<|patch|>``, then ``<|image_end|>``. vLLM replaces the prompt's one ``<|image|>`` with all of it and
  embeds only the ``<|patch|>`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass


def supported_canvases(max_tiles: int, tile_px: int) -> list[tuple[int, int]]:
    """(height, width) in pixels of every tile arrangement with at most ``max_tiles`` tiles."""
    out = []
    for n in range(max_tiles, 0, -1):
        for rows in range(1, n + 1):
            if n % rows == 0:
                out.append((rows * tile_px, (n // rows) * tile_px))
    return out


def best_fit_canvas(height: int, width: int, canvases: list[tuple[int, int]],
                    resize_to_max_canvas: bool = False) -> tuple[int, int]:
    scales = [min(ch / height, cw / width) for ch, cw in canvases]
    up = [s for s in scales if s >= 1]
    if up:
        chosen = max(up) if resize_to_max_canvas else min(up)
    else:
        chosen = max(s for s in scales if s < 1)
    candidates = [c for c, s in zip(canvases, scales, strict=True) if s == chosen]
    return min(candidates, key=lambda c: c[0] * c[1])


@dataclass(frozen=True, slots=True)
class Llama4Rules:
    tile_px: int = 336
    patch_size: int = 14
    max_tiles: int = 16
    resize_to_max_canvas: bool = False
    merge_size: int = 2               # pixel shuffle 0.5

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile_px // self.patch_size) ** 2 // (self.merge_size * self.merge_size)

    @property
    def patches_per_tile(self) -> int:
        return (self.tile_px // self.patch_size) ** 2

    def tiles(self, width_px: int, height_px: int) -> tuple[int, int]:
        """(rows, cols) of tiles on the best-fit canvas."""
        ch, cw = best_fit_canvas(height_px, width_px, supported_canvases(self.max_tiles, self.tile_px),
                                 self.resize_to_max_canvas)
        return ch // self.tile_px, cw // self.tile_px

    def num_encoder_tiles(self, rows: int, cols: int) -> int:
        return rows * cols + (1 if rows * cols > 1 else 0)


@dataclass(frozen=True, slots=True)
class Llama4TokenIds:
    image_start: int = 200080
    image_end: int = 200081
    tile_x_separator: int = 200084
    tile_y_separator: int = 200085
    image: int = 200090              # the prompt's one placeholder per image (the chat template's <|image|>)
    patch: int = 200092


def llama4_replacement(rows: int, cols: int, tokens_per_tile: int, ids: Llama4TokenIds) -> list[int]:
    """The token ids that replace one image's ``<|image|>`` placeholder."""
    out = [ids.image_start]
    if rows * cols > 1:
        for _ in range(rows):
            for x in range(cols):
                out += [ids.patch] * tokens_per_tile
                if x < cols - 1:
                    out.append(ids.tile_x_separator)
            out.append(ids.tile_y_separator)
    out.append(ids.image)
    out += [ids.patch] * tokens_per_tile
    out.append(ids.image_end)
    return out
