"""Workflows: the model and its validation, templates, block types and the executor."""
