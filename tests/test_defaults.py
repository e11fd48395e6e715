"""What `kvserve serve` chooses when the user does not: the model dtype from the CPU's flags, and the allocator."""

from __future__ import annotations

import pytest

from kvserve import allocator, cli, cpu_dtype

CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
flags\t\t: fpu sse2 avx avx2 {extra}
bogomips\t: 4000.00

processor\t: 1
flags\t\t: fpu sse2
"""


@pytest.mark.parametrize(
    "vendor, extra, want",
    [
        ("GenuineIntel", "avx512f avx512_bf16 amx_bf16 amx_tile", "bfloat16"),  # Sapphire Rapids: AMX tiles
        ("AuthenticAMD", "avx512f avx512_bf16", "bfloat16"),  # Zen 4 EPYC: AVX512-BF16, no AMX
        ("AuthenticAMD", "fma", "float32"),  # Zen 2/3 EPYC: AVX2 only, bf16 emulated
        ("GenuineIntel", "avx512f avx512bw", "float32"),  # Skylake/Cascade Lake: AVX-512 without bf16
    ],
)
def test_default_dtype_follows_native_bf16(vendor, extra, want):
    flags = cpu_dtype.cpu_flags(CPUINFO.format(vendor=vendor, extra=extra))
    assert "avx2" in flags  # the first CPU's flags line was read
    dtype, why = cpu_dtype.default_dtype(flags)
    assert dtype == want
    present = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in extra]
    assert why.startswith("the CPU has native bf16 (" + ", ".join(present)) if present else why.startswith("no ")


def serve_command(monkeypatch, argv: list[str], tcmalloc: str | None, env: dict | None = None) -> tuple[list, dict]:
    """What `kvserve serve ARGV` would exec (command, environment), on a CPU with AVX2 only."""
    captured = {}
    monkeypatch.setattr(cli.os, "environ", dict(env or {}))
    monkeypatch.setattr(cli, "default_dtype", lambda: cpu_dtype.default_dtype({"avx2"}))
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: tcmalloc)
    monkeypatch.setattr(cli.os, "execve", lambda path, command, environ: captured.update(command=command, env=environ))
    cli.serve(["/models/m", *argv])
    return captured["command"], captured["env"]


def test_serve_picks_the_dtype_unless_given(monkeypatch):
    command, _ = serve_command(monkeypatch, ["--port", "8000"], tcmalloc=None)
    assert command[command.index("--dtype") + 1] == "float32"
    for given in (["--dtype", "bfloat16"], ["--dtype=bfloat16"]):
        command, _ = serve_command(monkeypatch, given, tcmalloc=None)
        assert [arg for arg in command if arg.startswith("--dtype")] == [given[0]]  # the user's, once


def test_serve_preloads_tcmalloc_when_installed_else_caps_glibcs_mmap_threshold(monkeypatch):
    _, env = serve_command(
        monkeypatch, [], tcmalloc="/usr/lib/libtcmalloc_minimal.so.4", env={"LD_PRELOAD": "/opt/other.so"}
    )
    assert env["LD_PRELOAD"].split() == ["/usr/lib/libtcmalloc_minimal.so.4", "/opt/other.so"]
    assert "MALLOC_MMAP_THRESHOLD_" not in env  # tcmalloc does not fragment: no mmap tax
    _, env = serve_command(monkeypatch, [], tcmalloc=None)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(allocator.GLIBC_MMAP_THRESHOLD) and "LD_PRELOAD" not in env
    _, env = serve_command(
        monkeypatch, [], tcmalloc="/usr/lib/libtcmalloc_minimal.so.4", env={allocator.ALLOCATOR_ENV: "glibc"}
    )
    assert "LD_PRELOAD" not in env and "MALLOC_MMAP_THRESHOLD_" in env
    with pytest.raises(SystemExit, match="not installed"):
        serve_command(monkeypatch, [], tcmalloc=None, env={allocator.ALLOCATOR_ENV: "tcmalloc"})


def test_default_model_is_served_by_its_name_unless_told(monkeypatch, tmp_path):
    import kvserve.model
    from kvserve.server.launch import parse_serve_args

    monkeypatch.setattr(kvserve.model, "ensure_default_model", lambda: tmp_path / "cache" / "SmolLM2-135M-Instruct")
    args = parse_serve_args(["--port", "8000", "--dtype", "float32"])
    assert args.model == str(tmp_path / "cache" / "SmolLM2-135M-Instruct")
    assert args.served_model_name == ["SmolLM2-135M-Instruct"]
    assert parse_serve_args(["--served-model-name", "mine"]).served_model_name == ["mine"]
    args = parse_serve_args(["/models/other", "--dtype", "float32"])  # a model the user names keeps vLLM's naming
    assert args.model == "/models/other" and args.served_model_name is None


@pytest.mark.parametrize(
    "argv",
    [
        ["/models/other", "--port", "8014"],
        ["--port", "8014", "/models/other", "--dtype", "float32"],  # after a flag's value, as `vllm serve` takes it
        ["--enforce-eager", "/models/other"],  # after a flag without a value
        ["--model", "/models/other", "--port", "8014"],
        ["/models/other", "--model=/models/other"],  # the same model twice is one model
    ],
)
def test_the_server_serves_the_model_it_is_given_wherever_it_stands(monkeypatch, argv):
    import kvserve.model
    from kvserve.server.launch import parse_serve_args

    monkeypatch.setattr(kvserve.model, "ensure_default_model", lambda: pytest.fail("the default model was chosen"))
    assert parse_serve_args(argv).model == "/models/other"


def test_two_different_models_are_refused():
    from kvserve.server.launch import parse_serve_args

    with pytest.raises(SystemExit, match="two models given"):
        parse_serve_args(["/models/one", "--port", "8014", "--model", "/models/two"])


def test_the_cli_passes_the_model_to_the_server_wherever_it_stands(monkeypatch):
    monkeypatch.setattr(cli.os, "environ", {})  # serve() sets the server's environment in its own process
    monkeypatch.setattr(cli.os, "execve", lambda path, command, environ: captured.update(command=command))
    captured: dict = {}
    cli.serve(["--port", "8014", "--kv-budget", "64", "/models/other", "--kv-policy", "h2o", "--dtype", "float32"])
    command = captured["command"]
    assert command[1:3] == ["-m", "kvserve.server.launch"]
    assert "/models/other" in command and "--kv-policy" not in command  # kvserve's own flags stay here


def test_serve_help_lists_kvserves_flags_before_vllms():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert "--kv-policy" in text and "--max-model-len" in text  # kvserve's, then vLLM's own help
    assert text.index("--kv-policy") < text.index("--kv-budget") < text.index("--max-model-len")
