"""The one error of a row's images."""


class ImageError(ValueError):
    """This image cannot be had (fetched, read, decoded, refused, or it is too large): its row's error."""
