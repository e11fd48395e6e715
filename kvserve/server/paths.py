"""The HTTP paths kvserve's API server treats as its own, in one place: the middleware that reads eviction
settings and the document compressor name them from here."""

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")  # generation: eviction settings apply
COMPRESS_PATH = "/v1/kvserve/compress"  # compress a document once (kvserve/server/documents.py)
