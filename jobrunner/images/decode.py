"""An image's bytes -> an upright PIL image, as Hugging Face decodes it before its processor sees it.

datasets' Image feature and transformers' load_image both apply the EXIF orientation (a photo taken
sideways is turned upright); so do we. The mode is left as it is: the model's image processor converts
to RGB itself (engine.ImageProcessor.prepare, as transformers' do_convert_rgb: transparency laid over
white), so an image gives the pixels it gives there. Size is checked from the header, before the pixels
are decoded: an image over max_pixels (a decompression bomb, or only a huge scan) fails its row undecoded.
"""
from __future__ import annotations

import io

from jobrunner.images.image_error import ImageError


def pil():
    """PIL.Image, imported on first use (a text job never loads it)."""
    try:
        from PIL import Image, ImageOps  # noqa: F401
    except ImportError:
        raise ImageError("reading images needs Pillow: pip install pillow") from None
    return Image


def decode(data, max_pixels: int, what: str = "image"):
    """`data` (encoded bytes, or a PIL image) as a decoded, upright PIL image (an animated one: its first
    frame); ImageError when it does not decode or holds more than max_pixels pixels. what: the image's
    name in messages."""
    Image = pil()
    from PIL import ImageOps

    try:
        image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))   # the header only
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"{what}: {width}x{height} is {width * height} pixels, over --max-image-pixels "
                             f"{max_pixels}")
        image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as e:       # over twice PIL's own limit (179M pixels), whatever ours
        raise ImageError(f"{what}: Pillow refuses it as a decompression bomb ({e})") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file: all are the row's error
        kind = "not an image Pillow can read" if isinstance(e, Image.UnidentifiedImageError) else \
            f"does not decode ({type(e).__name__}: {e})"
        raise ImageError(f"{what}: {kind}") from None
    if image.getexif().get(0x0112) is not None:         # Orientation, as datasets' Image feature checks it
        image = ImageOps.exif_transpose(image)
    return image
