"""The router's table of which models run ControlNets (argus/contracts/generate.py) against
the worker's own models: the tiny stand-ins' UNets and the tiny ControlNets' bases."""

from __future__ import annotations

import pytest

from argus.contracts.generate import CONTROLNET_FAMILIES, runs_controlnets
from argus.profiles import default_profiles
from argus.worker.adapters.controlnet.models import base_family, tiny_unet_config
from argus.worker.models.sources import TINY_PREFIX, TINY_VARIANTS, build_tiny_pipeline

pytestmark = pytest.mark.unit

# what a ControlNet copies from the UNet it was trained beside, and must match to add its
# residuals to that UNet's blocks
SHAPE = (
    "block_out_channels",
    "layers_per_block",
    "cross_attention_dim",
    "down_block_types",
    "addition_embed_type",
    "attention_head_dim",
)


def shape(config: dict) -> tuple:
    return tuple(str(config.get(key)) for key in SHAPE)


@pytest.mark.parametrize("model", sorted(TINY_VARIANTS))
def test_the_router_table_says_what_the_worker_can_run(model: str) -> None:
    """A model the table gives a family has a UNet of that family's ControlNet base, as the
    worker reads its family; one it says runs none has a UNet no ControlNet of the catalog
    fits. Every tiny stand-in (the profile's models) is in the table."""
    unet = dict(build_tiny_pipeline(TINY_PREFIX + model).unet.config)
    family = CONTROLNET_FAMILIES[model]
    if family is not None:
        assert runs_controlnets(model) and base_family(unet) == family
        assert shape(unet) == shape(dict(tiny_unet_config(family)))
    else:
        assert not runs_controlnets(model)
        assert all(shape(unet) != shape(dict(tiny_unet_config(f))) for f in ("sd15", "sdxl"))


def test_a_model_the_table_does_not_know_is_left_to_its_worker() -> None:
    assert runs_controlnets("my-finetuned-sdxl")
    assert {level.model for level in default_profiles().levels} <= set(CONTROLNET_FAMILIES)
