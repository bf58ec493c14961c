"""Every DiffusionRunner (the served reader's, and each bench's) leaves cuDNN out of SDPA's kernels,
before the warm-up and the captures: cuDNN builds a plan for each new attention shape (one call of
1.6 s in an eager 32-row decoder pass on the H200), and the served passes meet new prompt lengths
all the time (app/engine/hf/layers.py `choose_attention_kernels`)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_reader


@pytest.fixture
def cudnn_sdp_on():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_building_a_reader_turns_cudnn_attention_off_and_keeps_the_others(tiny_dir, cudnn_sdp_on):
    assert torch.backends.cuda.cudnn_sdp_enabled()
    others = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
              torch.backends.cuda.math_sdp_enabled())
    make_tiny_reader(tiny_dir)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled()) == others
