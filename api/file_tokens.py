"""A job's files tokenized before the job exists: what the host will train on must fit.

`job_files_check_tokens` tokenizes the training and validation files with the base model's
training tokenizer (`api.base_model_tokenizers`) by the hosts' own rule
(`gpu_runtime.contract.training_data`) under the hosts' limit (`training_max_seq_len` of the
base model's context length, the JobSpec's `max_seq_len`), and raises a 400 naming the file
(`param` `training_file` or `validation_file`), the lines and their token counts, so a job the
host would refuse is never queued. Messages name files by id, never by storage key.
"""

from __future__ import annotations

from api.base_model_tokenizers import base_model_tokenizer
from api.errors import HarliError
from api.models import BaseModel, File
from api.storage import get_storage
from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.training_data import (
    MAX_TRAINING_SEQ_LEN,
    ExamplesTooLongError,
    TokenizedFile,
    TrainingDataError,
    jsonl_lines,
    tokenize_training_lines,
    training_max_seq_len,
)


def file_tokenize(
    *, file: File, role: str, tokenizer: ChatTokenizer, base_model: BaseModel
) -> TokenizedFile:
    """Tokenize `file` (`role`: "training" or "validation") as a host would for `base_model`;
    HarliError (400, param `<role>_file`) when a host would refuse it."""
    param = f"{role}_file"
    limit = training_max_seq_len(base_model.context_length)
    try:
        data = b"".join(get_storage().read_chunks(file.storage_key))
    except FileNotFoundError:
        raise HarliError(
            f"The content of file {file.id} is missing; upload it again.",
            param=param,
            code="invalid_file",
        ) from None
    try:
        return tokenize_training_lines(
            jsonl_lines(data), tokenizer, limit, source=f"{role.capitalize()} file {file.id}"
        )
    except ExamplesTooLongError as exc:
        raise HarliError(
            f"{exc}. The limit is the context length of base model {base_model.name} "
            f"({base_model.context_length} tokens), at most {MAX_TRAINING_SEQ_LEN}; "
            "shorten or split those examples.",
            param=param,
            code="example_too_long",
        ) from None
    except TrainingDataError as exc:
        raise HarliError(str(exc), param=param, code="invalid_file_format") from None


def job_files_check_tokens(
    *, base_model: BaseModel, training_file: File, validation_file: File | None
) -> None:
    """Refuse (HarliError) files a host would refuse for `base_model`; see the module docstring.
    ConflictError (409) when the base model's tokenizer is not available yet."""
    tokenizer = base_model_tokenizer(base_model=base_model)
    file_tokenize(file=training_file, role="training", tokenizer=tokenizer, base_model=base_model)
    if validation_file is not None:
        file_tokenize(
            file=validation_file, role="validation", tokenizer=tokenizer, base_model=base_model
        )
