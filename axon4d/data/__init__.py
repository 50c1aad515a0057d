"""Training tokens.

    tokens   token streams for training: synthetic, a corpus made offline, token files
    prepare  ``axon4d prepare-data``: text to a token file with a Hugging Face tokenizer

This package's ``__init__`` imports nothing; import the modules by their full names.
"""
