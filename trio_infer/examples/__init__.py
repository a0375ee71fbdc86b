"""The built-in example repository, served when no repository is given.

One folder per model, each with a ``model-settings.json``; the classes are in
``trio_infer.examples.models``. ``trio_infer.repository.settings.EXAMPLES`` is this folder.
"""
