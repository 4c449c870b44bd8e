"""Kept for tools that still call `setup.py`; the package metadata lives in pyproject.toml."""

import setuptools

setuptools.setup()
