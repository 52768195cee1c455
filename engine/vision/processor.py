"""Image preprocessing for the vision-language families, on PIL and numpy (no torch, no transformers).

Each step is transformers' *Pil image processor's own, in the same order and dtypes, so the pixels are
equal to theirs: RGB (transparency composited on white), resize with PIL (bicubic by default), rescale in
float64 then float32, normalize in float32.

    Qwen2-VL, Qwen2.5-VL (Qwen2VLImageProcessorPil): smart_resize to multiples of patch * merge within
    [min_pixels, max_pixels], then patches: pixels [h * w, C * temporal * p * p] (each patch repeated over
    the temporal_patch_size frames an image is), rows in merge-block order; grid (1, h, w) in patches;
    tokens t * h * w / merge^2.
    LLaVA (LlavaImageProcessorPil, CLIPImageProcessorPil): optional pad to square, resize (shortest edge,
    or height and width), center crop; pixels [C, H, W]; grid (1, H / p, W / p); tokens the tower's rows
    kept: the patches, and the CLS row under the "full" feature strategy.

A prompt's text holds one image token per image (the chat template writes it); `expand` repeats each
to the image's count before the ids go to the engine (engine.request.ImageInput: offset, length).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jobrunner.engine.config import architectures as registry

if TYPE_CHECKING:
    from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3
_KEY_MASK = (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class PreparedImage:
    pixels: np.ndarray                  # float32, the family's layout (see the module doc)
    grid: tuple[int, int, int]          # (t, h, w) in patches, before any merge
    num_tokens: int                     # the placeholder tokens it fills (the tower's output rows)


def image_key(image: PreparedImage) -> int:
    """A 63-bit content hash of an image's grid and pixels (blake2b, 8 bytes): ImageInput.key."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(image.grid, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(image.pixels, dtype=np.float32).tobytes())
    return int.from_bytes(h.digest(), "little") & _KEY_MASK


class ImageProcessor:
    """A checkpoint's image preprocessing (prepare) and its placeholder tokens (expand)."""
    image_token: str                    # what the chat template writes per image
    image_token_id: int

    def prepare(self, image: "Image.Image") -> PreparedImage:
        raise NotImplementedError

    def expand(self, ids: list[int], images: list[PreparedImage]) -> tuple[list[int], list[int]]:
        """ids with each image token (one per image, in order) repeated its image's num_tokens times ->
        (new ids, the first index of each image's run). ValueError if the counts disagree."""
        token = self.image_token_id
        found = [i for i, t in enumerate(ids) if t == token]
        if len(found) != len(images):
            raise ValueError(f"the prompt has {len(found)} image tokens ({self.image_token}) for {len(images)} images")
        out, offsets, last = [], [], 0
        for i, image in zip(found, images):
            out.extend(ids[last:i])
            offsets.append(len(out))
            out.extend([token] * image.num_tokens)
            last = i + 1
        out.extend(ids[last:])
        return out, offsets


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2VLImageProcessorPil's preprocessing (Qwen2-VL and Qwen2.5-VL)."""

    def __init__(self, pre: dict, image_token: str, image_token_id: int):
        self.image_token, self.image_token_id = image_token, image_token_id
        size = dict(pre.get("size") or {})
        self.min_pixels = pre.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
        self.max_pixels = pre.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
        self.patch_size = pre.get("patch_size", 14)
        self.temporal_patch_size = pre.get("temporal_patch_size", 2)
        self.merge_size = pre.get("merge_size", 2)
        self.steps = _Steps.from_config(pre)

    def prepare(self, image: "Image.Image") -> PreparedImage:
        pil = self.steps.rgb(image)
        if self.steps.do_resize:
            factor = self.patch_size * self.merge_size
            h, w = smart_resize(pil.height, pil.width, factor, self.min_pixels, self.max_pixels)
            pil = pil.resize((w, h), resample=self.steps.resample)
        chw = self.steps.scale(_chw(pil))
        patches, gh, gw = self._patchify(chw)
        return PreparedImage(patches, (1, gh, gw), gh * gw // self.merge_size ** 2)

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """[C, H, W] -> [gh * gw, C * temporal * p * p] in merge-block order (gh/m, gw/m, m, m), each patch
        repeated over the temporal frames, as Qwen2VLImageProcessorPil.patchify."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        c, h, w = image.shape
        gh, gw = h // p, w // p
        patches = image.astype(np.float32).reshape(c, gh // m, m, p, gw // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)                # (gh/m, gw/m, m, m, C, p, p)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
        return patches.reshape(gh * gw, c * tp * p * p), gh, gw


class LlavaImageProcessor(ImageProcessor):
    """LlavaImageProcessorPil's preprocessing (CLIPImageProcessorPil's, when do_pad is off)."""

    def __init__(self, pre: dict, image_token: str, image_token_id: int, patch_size: int, keeps_cls: bool):
        self.image_token, self.image_token_id = image_token, image_token_id
        self.patch_size, self.keeps_cls = patch_size, keeps_cls
        self.size = _size_dict(pre.get("size", {"shortest_edge": 224}), square=False)
        self.crop_size = _size_dict(pre.get("crop_size", {"height": 224, "width": 224}), square=True)
        self.do_center_crop = pre.get("do_center_crop", True)
        self.do_pad = pre.get("do_pad", False)
        self.steps = _Steps.from_config(pre)

    def prepare(self, image: "Image.Image") -> PreparedImage:
        from PIL import Image as PILImage

        pil = self.steps.rgb(image)
        if self.do_pad:
            pil = PILImage.fromarray(_pad_to_square(np.asarray(pil), self.steps.mean))
        if self.steps.do_resize:
            h, w = _resized_size(pil.height, pil.width, self.size)
            pil = pil.resize((w, h), resample=self.steps.resample)
        chw = _chw(pil)
        if self.do_center_crop:
            chw = _center_crop(chw, self.crop_size["height"], self.crop_size["width"])
        chw = self.steps.scale(chw)
        gh, gw = chw.shape[1] // self.patch_size, chw.shape[2] // self.patch_size
        return PreparedImage(np.ascontiguousarray(chw, dtype=np.float32), (1, gh, gw), gh * gw + int(self.keeps_cls))


def load_image_processor(hf_config: dict, preprocessor: dict, tokenizer=None) -> ImageProcessor | None:
    """The image processor of a checkpoint: config.json (hf_config), preprocessor_config.json's dict, and
    its tokenizer (for the image token's spelling; None: the family's usual one). None for a text model."""
    arch = (hf_config.get("architectures") or [registry.DEFAULT_ARCHITECTURE])[0]
    if arch not in registry.ARCHITECTURES or registry.ARCHITECTURES[arch].vision is None:
        return None
    kind = registry.ARCHITECTURES[arch].vision
    from jobrunner.engine.config.vision_config import VisionConfig
    vision = VisionConfig.from_hf(hf_config, kind, registry.text_architecture(arch, hf_config.get("text_config") or {}))
    default_token = "<image>" if kind == "llava" else "<|image_pad|>"
    token = (tokenizer.id_to_token(vision.image_token_id) if tokenizer is not None else None) or default_token
    if kind == "llava":
        return LlavaImageProcessor(preprocessor, token, vision.image_token_id, vision.patch_size,
                                   keeps_cls=vision.feature_strategy == "full")
    return Qwen2VLImageProcessor(preprocessor, token, vision.image_token_id)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Qwen2-VL's resize target: both sides multiples of factor, the area within [min_pixels, max_pixels],
    the aspect ratio kept as nearly as that allows (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class _Steps:
    """The steps every family shares: RGB conversion, the resampling filter, rescale and normalize."""
    do_convert_rgb: bool
    do_resize: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_config(cls, pre: dict) -> "_Steps":
        mean, std = pre.get("image_mean", OPENAI_CLIP_MEAN), pre.get("image_std", OPENAI_CLIP_STD)
        return cls(do_convert_rgb=pre.get("do_convert_rgb", True), do_resize=pre.get("do_resize", True),
                   resample=int(pre.get("resample", _BICUBIC)), do_rescale=pre.get("do_rescale", True),
                   rescale_factor=float(pre.get("rescale_factor", 1 / 255)), do_normalize=pre.get("do_normalize", True),
                   mean=tuple(mean) if isinstance(mean, (list, tuple)) else (mean,) * 3,
                   std=tuple(std) if isinstance(std, (list, tuple)) else (std,) * 3)

    def rgb(self, image: "Image.Image") -> "Image.Image":
        """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
        from PIL import Image as PILImage

        if not self.do_convert_rgb:
            return image
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
            return PILImage.alpha_composite(background, rgba).convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")

    def scale(self, chw: np.ndarray) -> np.ndarray:
        """uint8 [C, H, W] -> float32: times rescale_factor (in float64, as transformers), then (x - mean) / std."""
        image = chw
        if self.do_rescale:
            image = (image.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            if not np.issubdtype(image.dtype, np.floating):
                image = image.astype(np.float32)
            mean = np.asarray(self.mean, dtype=image.dtype)[:, None, None]
            std = np.asarray(self.std, dtype=image.dtype)[:, None, None]
            image = (image - mean) / std
        return image.astype(np.float32, copy=False)


def _chw(pil: "Image.Image") -> np.ndarray:
    array = np.asarray(pil)
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def _size_dict(size, square: bool) -> dict:
    """A preprocessor_config size as a dict: an int is a shortest edge (square=False) or a square."""
    if isinstance(size, int):
        return {"height": size, "width": size} if square else {"shortest_edge": size}
    return dict(size)


def _resized_size(height: int, width: int, size: dict) -> tuple[int, int]:
    """(height, width) of a CLIP-style resize, as transformers' PilBackend.resize computes it."""
    if size.get("shortest_edge") and size.get("longest_edge"):
        return _size_with_aspect_ratio(height, width, size["shortest_edge"], size["longest_edge"])
    if size.get("shortest_edge"):
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    if size.get("height") and size.get("width"):
        return size["height"], size["width"]
    raise ValueError(f"preprocessor size {size}: expected shortest_edge, or height and width")


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' get_size_with_aspect_ratio: the shorter side to size unless the longer would pass max_size."""
    raw = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw = max_size * lo / hi
        size = int(round(raw))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return int((raw if raw is not None else size) * height / width), size
    return size, int((raw if raw is not None else size) * width / height)


def _center_crop(image: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """[C, H, W] cropped about its center; a side shorter than the crop is padded with zeros first
    (transformers' center_crop)."""
    _, h, w = image.shape
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return image[:, top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((image.shape[0], new_h, new_w), dtype=image.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, top_pad:top_pad + h, left_pad:left_pad + w] = image
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def _pad_to_square(hwc: np.ndarray, mean: tuple[float, ...]) -> np.ndarray:
    """[H, W, C] uint8 centered on a square of the mean color (LlavaImageProcessorPil.pad_to_square)."""
    h, w, c = hwc.shape
    if h == w:
        return hwc
    side = max(h, w)
    out = np.empty((side, side, c), dtype=hwc.dtype)
    out[:] = np.asarray([int(x * 255) for x in mean], dtype=hwc.dtype)
    if w > h:
        start = (side - h) // 2
        out[start:start + h] = hwc
    else:
        start = (side - w) // 2
        out[:, start:start + w] = hwc
    return out
