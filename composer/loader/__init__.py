"""The first stage: a pipeline file's text to plain data, with where each value came from.

:mod:`.file` reads the file (its size bounded), :mod:`.load` parses it safely
(:func:`load_yaml`), :mod:`.positions` maps YAML's marks to an editor's lines and
columns, :mod:`.limits` bounds hostile input while it is read (depth, values,
numbers), :mod:`.env_vars` expands ``${VAR}``. The names other modules use are
handed on here.
"""

from composer.loader.env_vars import EnvProblem, expand_env
from composer.loader.file import (
    MAX_FILE_BYTES,
    FileProblem,
    decode_pipeline,
    read_pipeline_file,
    read_pipeline_stream,
)
from composer.loader.limits import (
    MAX_DEPTH,
    MAX_NUMBER_CHARS,
    MAX_VALUES,
    LimitExceeded,
    PipelineLoader,
)
from composer.loader.load import YAMLProblem, file_marks, load_yaml, syntax_problem
from composer.loader.positions import Marks

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NUMBER_CHARS",
    "MAX_VALUES",
    "EnvProblem",
    "FileProblem",
    "LimitExceeded",
    "Marks",
    "PipelineLoader",
    "YAMLProblem",
    "decode_pipeline",
    "expand_env",
    "file_marks",
    "load_yaml",
    "read_pipeline_file",
    "read_pipeline_stream",
    "syntax_problem",
]
