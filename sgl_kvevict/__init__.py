"""sgl-kvevict: decode-time KV-cache compression inside the real SGLang server."""

__version__ = "0.2.0"
