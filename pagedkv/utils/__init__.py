"""Small helpers the whole library shares, kept where vLLM 0.26 keeps its own (``vllm/utils/``)."""

from pagedkv.utils.math_utils import cdiv
from pagedkv.utils.validation import check_int, is_int, is_real

__all__ = ["cdiv", "check_int", "is_int", "is_real"]
