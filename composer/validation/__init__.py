"""YAML -> validated model -> resolved graph, reporting every problem at once.

:mod:`.validate` drives it; the names other modules use are handed on here.
"""

from composer.validation.validate import load_pipeline, validate_data, validate_text

__all__ = ["load_pipeline", "validate_data", "validate_text"]
