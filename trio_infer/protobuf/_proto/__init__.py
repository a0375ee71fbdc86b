"""Generated protocol modules; do not edit. Regenerate with ``python protos/generate.py``."""
