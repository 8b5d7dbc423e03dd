"""scripts/torch-install-args.sh: which torch build set-up installs, decided without installing.

Each case runs the script with its own pip configuration (none, or a find-links folder with a
stand-in torch wheel) and a fake ``nvidia-smi`` first on PATH, and reads the pip arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "torch-install-args.sh"
PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def fake_torch_wheel(folder: Path) -> Path:
    """A tiny wheel that pip takes for torch 2.13.0 (metadata only, nothing to import)."""
    dist = "torch-2.13.0.dist-info"
    path = folder / "torch-2.13.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("torch/__init__.py", "")
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
        whl.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        )  # fmt: skip
        whl.writestr(f"{dist}/RECORD", "")
    return path


def fake_nvidia_smi(bin_dir: Path, *, gpus: bool) -> None:
    """An ``nvidia-smi`` that lists one GPU, or fails as it does on a machine without one."""
    script = bin_dir / "nvidia-smi"
    if gpus:
        script.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
    else:
        script.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    script.chmod(0o755)


def torch_args(
    tmp_path: Path, *, gpus: bool, local_wheel: bool, **env: str
) -> tuple[list[str], str]:
    """The script's pip arguments and its one-line note, for the given machine.

    Raises:
        subprocess.CalledProcessError: the script failed.
    """
    bin_dir, links = tmp_path / "bin", tmp_path / "wheels"
    bin_dir.mkdir(exist_ok=True)
    links.mkdir(exist_ok=True)
    fake_nvidia_smi(bin_dir, gpus=gpus)
    if local_wheel:
        fake_torch_wheel(links)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DDPQ_TORCH"))}
    run_env = {
        **base,
        # This machine's pip.conf (its own find-links) must not decide the case.
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(links),
        "PATH": os.pathsep.join(
            [str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
        ),
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=run_env, capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.splitlines(), done.stderr.strip()


def test_spec_with_pip_options_is_split_like_a_shell(tmp_path: Path) -> None:
    spec = f"{PIN} --index-url {CPU_INDEX} --extra-index-url 'file:///a b/simple'"
    args, note = torch_args(tmp_path, gpus=True, local_wheel=True, DDPQ_TORCH_SPEC=spec)
    assert args == [PIN, "--index-url", CPU_INDEX, "--extra-index-url", "file:///a b/simple"]
    assert note.startswith("setup: torch: as asked"), note


def test_spec_is_never_run_as_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    spec = f"torch $(touch {marker}) `touch {marker}`; touch {marker}"
    args, _ = torch_args(tmp_path, gpus=False, local_wheel=False, DDPQ_TORCH_SPEC=spec)
    assert not marker.exists(), "the spec was executed"
    assert args[:3] == ["torch", "$(touch", f"{marker})"], "kept as words, not expanded"


def test_index_url_alone_applies_to_the_pinned_torch(tmp_path: Path) -> None:
    url = "https://download.pytorch.org/whl/cu126"
    args, _ = torch_args(tmp_path, gpus=False, local_wheel=True, DDPQ_TORCH_INDEX_URL=url)
    assert args == [PIN, "--index-url", url]
    both, _ = torch_args(
        tmp_path,
        gpus=False,
        local_wheel=True,
        DDPQ_TORCH_SPEC="torch>=2.5",
        DDPQ_TORCH_INDEX_URL=url,
    )
    assert both == ["torch>=2.5", "--index-url", url]


@pytest.mark.parametrize("gpus", [True, False])
def test_a_local_wheel_wins_over_any_download(tmp_path: Path, gpus: bool) -> None:
    args, note = torch_args(tmp_path, gpus=gpus, local_wheel=True)
    assert args == [PIN], "the wheel pip finds in find-links, as CI here installs it"
    assert "local wheel" in note and "no download" in note, note


def test_no_gpu_takes_the_cpu_build_from_pytorchs_index(tmp_path: Path) -> None:
    args, note = torch_args(tmp_path, gpus=False, local_wheel=False)
    assert args == [PIN, "--index-url", CPU_INDEX]
    assert "no CUDA GPU" in note and "200 MB" in note, note


def test_a_gpu_takes_the_default_cuda_build(tmp_path: Path) -> None:
    args, note = torch_args(tmp_path, gpus=True, local_wheel=False)
    assert args == [PIN], "the package index's default build, which is CUDA's"
    assert "CUDA GPU found" in note and "3 GB" in note, note


def test_setup_passes_the_arguments_as_separate_words() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/torch-install-args.sh" in setup
    assert 'pipq "${torch_args[@]}"' in setup, "one quoted argument cannot carry pip options"


def test_an_unsplittable_spec_fails_saying_so(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as info:
        torch_args(tmp_path, gpus=False, local_wheel=False, DDPQ_TORCH_SPEC="torch 'unclosed")
    assert info.value.returncode == 2 and "DDPQ_TORCH_SPEC" in info.value.stderr
    assert info.value.stdout == "", "no arguments for pip when the spec is unusable"
