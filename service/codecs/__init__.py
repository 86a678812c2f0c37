"""Wire formats: JSON (host and device), KServe v2 bodies, safetensors."""
