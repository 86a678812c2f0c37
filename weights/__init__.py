"""Layer directories: the service's on-disk format, converters from Hugging Face checkpoints,
and loading onto the device."""
