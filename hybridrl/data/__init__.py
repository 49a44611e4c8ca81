"""Datasets for RL, preference and SFT training; a resumable loader; the synthetic arithmetic task.

Knows nothing about models or GPUs: it reads rows, validates them with errors that name the file,
row, field and fix, and tokenises them with a HuggingFace tokenizer.
"""

from hybridrl.data.arith import (
    arith_sft_rows,
    make_arith_preference_rows,
    make_arith_rows,
    make_arith_unpaired_rows,
    write_arith_dataset,
)
from hybridrl.data.errors import DataError
from hybridrl.data.loader import StatefulLoader
from hybridrl.data.preference import (
    PreferenceExample,
    UnpairedExample,
    load_preference_dataset,
    load_unpaired_dataset,
)
from hybridrl.data.prompts import PromptDataset, PromptExample, load_prompt_dataset
from hybridrl.data.sft import SFTExample, load_sft_dataset
from hybridrl.data.sources import read_rows

__all__ = [
    "DataError",
    "PreferenceExample",
    "PromptDataset",
    "PromptExample",
    "SFTExample",
    "StatefulLoader",
    "UnpairedExample",
    "arith_sft_rows",
    "load_preference_dataset",
    "load_prompt_dataset",
    "load_sft_dataset",
    "load_unpaired_dataset",
    "make_arith_preference_rows",
    "make_arith_rows",
    "make_arith_unpaired_rows",
    "read_rows",
    "write_arith_dataset",
]
