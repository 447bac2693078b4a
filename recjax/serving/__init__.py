"""Serving a trained run: read-only quantized tables (`tables`), the self-contained export (`export`), the loader that
reads an export with only jax and numpy (`loader`), and the batching HTTP server (`server`).

Nothing here is imported by the trainer; the loader and the server import no training code (tests/test_export.py)."""
