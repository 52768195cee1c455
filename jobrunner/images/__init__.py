"""A row's images, from wherever users keep them to the engine's Request.images (issue 44).

    sources.py   an image value (bytes, an image struct, a path, any fsspec URL, http(s) and data: URLs)
                 -> a Source -> its bytes (Fetcher: timeout, size limit, retries; paths confined to the
                 dataset's folder or an --image-root); ImageError for the row
    addresses.py which hosts an http(s) image may come from (public only unless allowed; --image-hosts)
    download.py  one http(s) download: pinned to the checked address, redirects checked, a deadline, cancel
    decode.py    bytes -> an upright RGB PIL image, as Hugging Face decodes one; --max-image-pixels
    prepare.py   the model's image processor on them in a thread pool (ImagePrep), the ImageInputs of a
                 row, the pixels of waiting rows kept in bounded memory (PixelStore, RowImages)

The intake (jobrunner/pipeline/intake.py) stages rows, submits their images and makes each row's request
when they are ready; a waiting row (job/pending.PendingRow) holds its images' keys and a RowImages.
PIL is imported on the first image: a text job never loads it.
"""
from jobrunner.images.prepare import NO_PIXELS, PIXEL_BUDGET, ImagePrep, PixelStore, Prepared, RowImages, image_inputs, image_key
from jobrunner.images.sources import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, DEFAULT_TIMEOUT_S, Fetcher, ImageError, ImageLimits, Source, column_images, dataset_base, source_of

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_PIXELS", "DEFAULT_TIMEOUT_S", "NO_PIXELS", "PIXEL_BUDGET", "Fetcher",
           "ImageError", "ImageLimits", "ImagePrep", "PixelStore", "Prepared", "RowImages", "Source", "column_images",
           "dataset_base", "image_inputs", "image_key", "source_of"]
