"""The common core of the kernel layer: the native library's loader (``native``), the option schema
the plugins' configs are parsed with, atomic output folders, the Hugging Face checkpoint reader, the
cached fetcher of the real models, and the plugin hooks' names."""
