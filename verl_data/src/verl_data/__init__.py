"""verl-data: where a run's prompts come from, the ``standard`` data reader (``data.reader``, the default).

It reads rows from parquet / jsonl / json files, dataset directories, Hugging Face Hub ids and
``builtin:`` or ``<provider>:<argument>`` datasets (:mod:`verl_data.rows`), renders their prompts to
token ids with the tokenizer's chat template, and rows with images with the model's image-text
processor (:mod:`verl_data.images`). The core reaches it through the
:class:`~verl_core.contracts.DataReader` contract (:class:`~verl_data.reader.StandardReader`, entry
point ``verl.data_readers``) and checks every row it hands over; other code (an environment's warm
start, a benchmark, a data tool) calls the functions here directly.
"""

__version__ = "0.1.0"

from verl_core.contracts import DataError  # noqa: E402 - after the version, which the build reads
from verl_data.images import ImageTextProcessor, decode_image, load_processor  # noqa: E402
from verl_data.rows import (OVERLONG_MODES, PromptStats, build_datasets, check_data_source,  # noqa: E402
                            generated_provider, load_rows, render_rows, tokenize_rows)

__all__ = ["__version__", "DataError", "OVERLONG_MODES", "PromptStats", "build_datasets", "check_data_source",
           "generated_provider", "load_rows", "render_rows", "tokenize_rows", "ImageTextProcessor", "decode_image",
           "load_processor"]
