"""remat.core.labels: the site labels and what each allows; a family may add labels, not redefine them."""

from __future__ import annotations

import pytest

from remat.core import labels
from remat.core.labels import LAYER, Label, register


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Label]:
    """A copy of the registry, so labels registered here leave the others' alone."""
    copy = dict(labels._REGISTRY)
    monkeypatch.setattr(labels, "_REGISTRY", copy)
    return copy


def test_megatrons_labels_come_first_and_say_how_they_recompute() -> None:
    assert labels.recompute_labels()[:7] == (
        "core_attn",
        "layernorm",
        "mlp",
        "moe",
        "moe_act",
        "shared_experts",
        "mla_up_proj",
    )
    assert {"layernorm", "moe_act", "mla_up_proj"} <= labels.discard_labels()
    assert "expert_fc1" in labels.offload_only_labels()
    assert "expert_fc1" not in labels.recompute_labels()
    assert labels.enclosing()["moe_act"] == "moe"
    assert labels.site_labels()[-1] == LAYER


def test_a_family_label_is_known_once_registered(registry) -> None:
    assert register(Label("my_act", discard=True)) == Label("my_act", discard=True)
    register(Label("my_act", discard=True))  # again: a no-op
    assert labels.recompute_labels()[-1] == "my_act"
    assert "my_act" in labels.discard_labels()


def test_a_megatron_label_without_model_is_runnable_once_a_family_registers_it(registry) -> None:
    assert "mhc" in labels.labels_without_model()
    register(Label("mhc"))
    assert "mhc" not in labels.labels_without_model()


@pytest.mark.parametrize(
    "label, message",
    [
        (Label("layernorm"), "already registered"),
        (Label(LAYER), "whole-layer site"),
        (Label("inner", enclosed_by="nowhere"), "'nowhere', which is not registered"),
    ],
)
def test_register_refuses_a_redefinition_the_layer_and_an_unknown_encloser(registry, label, message) -> None:
    with pytest.raises(ValueError, match=message):
        register(label)
    assert label.name not in registry or registry[label.name] != label
