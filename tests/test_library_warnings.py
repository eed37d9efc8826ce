"""The library lines no user can act on are silenced once `lightning_dist` is imported (lifecycle/library_warnings.py),
each where its library raises it, and nothing else: the same words from the user's own code still show."""

from __future__ import annotations

import logging
import warnings

import pytest

from lightning_dist.lifecycle.library_warnings import quiet_library_warnings

PEFT_MOE = ("The following rank_pattern keys did not match any targeted module and were ignored:"
            " ['.*\\\\.gate_up_proj'].")
DEPRECATED = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing`"


@pytest.mark.parametrize(("message", "category", "module"), [
    (PEFT_MOE, RuntimeWarning, "peft.tuners.tuners_utils"),
    (DEPRECATED, FutureWarning, "transformers.modeling_utils"),
])
def test_a_library_warning_is_silenced_where_its_library_raises_it_and_shows_from_the_users_code(message, category,
                                                                                                  module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_warnings()
        warnings.warn_explicit(message, category, "library.py", 1, module=module)
        warnings.warn_explicit(message, category, "train.py", 1, module="__main__")
    assert [str(w.message) for w in caught] == [message]  # the user's


def test_bitsandbytes_cpu_kernel_line_is_dropped_and_its_other_lines_kept(caplog):
    quiet_library_warnings()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: Kernel repository ...")
        logger.warning("something else")
    assert [record.getMessage() for record in caplog.records] == ["something else"]
