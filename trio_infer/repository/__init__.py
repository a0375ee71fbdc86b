"""The model repository: ``model-settings.json`` files and the models being served.

``settings`` reads and validates a repository's settings; ``registry`` holds the served models
and their readiness.

May import: ``trio_infer.datatypes`` and ``trio_infer.errors`` only: worker processes import the
settings too.
"""
