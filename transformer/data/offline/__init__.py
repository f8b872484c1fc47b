"""The offline TFDS builders: the corpora built from Debian packages."""
