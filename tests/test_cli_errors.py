"""``mmserve``'s command line on bad input: a value that would start a broken server (listening
elsewhere, without authentication, hanging or refusing every request) is a usage error naming
its flag, and a bad file or directory is one line, ``mmserve <command>: error: ...``, exit 1,
with nothing overwritten; ``models list`` names every modality's model. In-process
(``gateway.cli.main``), nothing loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.cli import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--port", "73676"], "--port: must be 0-65535"),
        (["serve", "--port", "-1"], "--port: must be 0 or more"),
        (["serve", "--api-key", ""], "--api-key: must be a non-empty key"),
        (["serve", "--api-key", "a key"], "--api-key: must be a non-empty key"),
        (["serve", "--only", ","], "--only: name at least one"),
        (["serve", "--kv-cache-gb", "0"], "--kv-cache-gb: must be a number more than 0"),
        (["serve", "--max-model-len", "0"], "--max-model-len: must be 1 or more"),
        (["serve", "--embed-workers", "-1"], "--embed-workers: must be 1 or more"),
        (["serve", "--diffusion-max-batch", "0"], "--diffusion-max-batch: must be 1 or more"),
        (["serve", "--max-body-mb", "-1"], "--max-body-mb: must be a number more than 0"),
        (["serve", "--files-max-mb", "nan"], "--files-max-mb: must be a number more than 0"),
        (["serve", "--jobs-ttl-h", "-1"], "--jobs-ttl-h: must be a number more than 0"),
        (["serve", "--jobs-max-queued", "-1"], "--jobs-max-queued: must be 1 or more"),
        (["serve", "--tts-workers", "x"], "--tts-workers: not a whole number"),
        (["serve", "--tts-max-requests", "-1"], "--tts-max-requests: must be 0 or more, got -1 (0: no bound)"),
        (["serve", "--max-waiting", "1.5"], "--max-waiting: not a whole number: '1.5' (0: no bound)"),
        (["serve", "--limit", "llm_tokens=inf"], "must be a positive number per minute"),
        (["serve", "--log-level", "bogus"], "--log-level: choose from debug"),
        (["serve", "--results-dir", __file__], "--results-dir: " + __file__ + " is not a directory"),
        (["worker", "--modality", "embed", "--heartbeat-s", "0"], "--heartbeat-s: must be a number more than 0"),
        (["worker", "--modality", "embed", "--concurrency", "0"], "--concurrency: must be 1 or more"),
        (["worker", "--modality", "embed", "--redis-url", "notaurl"], "--redis-url: a redis://"),
        (["serve", "--dispatch", "celery", "--redis-url", "localhost:6379"], "--redis-url: a redis://"),
        (["keys", "add", "--keys-file", "k.json", "--tenant", "t", "--limit", "llm_tokens=nan"], "positive number"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_its_flag(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mmserve {argv[0]}: error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_a_model_is_written_only_into_a_new_or_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert "not an empty directory" in _fails(["models", "make-tiny", "llama", str(mine)], capsys)
    assert [p.name for p in mine.iterdir()] == ["config.json"] and (mine / "config.json").read_text() == "{}"
    assert "is the source too" in _fails(["models", "import-whisper-ct2", str(mine), str(mine)], capsys)
    assert [p.name for p in mine.iterdir()] == ["config.json"]


def test_a_modality_asked_for_by_name_must_have_a_model() -> None:
    """(Else ``serve`` started a server with no model at all; ``serve`` prints this and exits 2.)"""
    from gateway.cli import build_parser
    from gateway.plugins import build_all

    with pytest.raises(ValueError, match="--only diffusion: give --image or --video"):
        build_all(build_parser().parse_args(["serve", "--only", "diffusion"]))


def test_a_bad_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file" in _fails(["models", "convert-gguf", str(tmp_path / "none.gguf")], capsys)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00")  # a GGUF header cut short
    _fails(["models", "convert-gguf", str(cut), str(tmp_path / "out")], capsys)
    keys = tmp_path / "keys.json"
    keys.write_text("{not json")
    _fails(["keys", "add", "--keys-file", str(keys), "--tenant", "t"], capsys)
    assert "is neither tiny.en" in _fails(["bench", "asr", "--model", str(cut)], capsys)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "tts", "--concurrency", "0"], "--concurrency: a comma list of whole numbers >= 1"),
        (["bench", "tts", "--rounds", "0"], "--rounds: must be 1 or more"),
        (["bench", "tts", "--out", "/tmp"], "--out: /tmp is a directory"),
        (["bench", "voice", "--sessions", "a,b"], "--sessions: a comma list"),
        (["bench", "step", "--batch", "0"], "--batch: must be 1 or more"),
        (["bench", "asr", "--clips", "0"], "--clips: must be 1 or more"),
    ],
)
def test_a_bench_takes_no_value_that_would_make_an_empty_table(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Before: NaN tables with exit 0, or a traceback after the whole run for a bad ``--out``.)"""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_keys_add_writes_through_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server reads the keys file through a link: the link stays, its target gets the key."""
    real, link = tmp_path / "real.json", tmp_path / "keys.json"
    assert main(["keys", "add", "--keys-file", str(real), "--tenant", "a"]) == 0
    link.symlink_to(real)
    assert main(["keys", "add", "--keys-file", str(link), "--tenant", "b"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and '"b"' in real.read_text() and '"a"' in real.read_text()


@pytest.mark.parametrize("case", ["garbage", "empty", "config", "list"])
def test_a_piper_voice_that_is_no_voice_is_one_line_before_the_server_starts(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(It failed inside the server's start-up: a traceback and exit 3.) Nothing is cached for it."""
    # (serve's logging set-up would point the root logger at this test's captured stderr for good)
    monkeypatch.setattr("gateway.logs.configure_logging", lambda *_: None)
    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path / "cache"))  # (what is cached: this test's alone)
    from engine.model_loader import cache_root
    from modalities.tts.piper_engine import default_voice_path

    real = default_voice_path()
    voice = tmp_path / f"{case}.onnx"
    voice.write_bytes({"garbage": b"not a model" * 100, "empty": b""}.get(case, real.read_bytes()))
    config = {"config": '{"audio": {}}', "list": "[]"}.get(case) or Path(f"{real}.json").read_text()
    Path(f"{voice}.json").write_text(config)
    assert main(["serve", "--only", "tts", "--tts", str(voice), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmserve serve: error: {voice}") and "Traceback" not in err and err.count("\n") == 1, err
    cached = cache_root() / "piper"
    assert not cached.exists() or not list(cached.iterdir()), "a cut of a file that is no voice was cached"


def test_a_toml_keys_file_without_tomllib_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Python 3.10 has no ``tomllib``: a traceback.)"""
    keys = tmp_path / "keys.toml"
    keys.write_text("[tenants.acme]\nkeys = []\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # (an import of it raises ImportError)
    assert "need Python 3.11" in _fails(["keys", "add", "--keys-file", str(keys), "--tenant", "t"], capsys)


def test_models_list_names_every_modalitys_default_and_every_tiny_arch(capsys: pytest.CaptureFixture[str]) -> None:
    """(It named the LLM's and the embedder's only, and the LLM's tiny archs.)"""
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for says in (
        "llm  smollm2 (default)",
        "embed ",
        "asr  whisper-tiny.en (default)",
        "asr  whisper-base",
        "tts  piper",
    ):
        assert says in out, out
    assert all(arch in out for arch in ("llama", "tts-ar", "dit", "video")), out


def test_a_worker_checks_redis_before_it_loads_a_model_and_names_its_own_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Before, a worker with a wrong ``--redis-url`` loaded its model, said it was serving, then
    retried Redis for minutes; its errors named ``serve``'s ``--only``.)"""
    import redis

    from gateway import plugins

    monkeypatch.setenv("C_FORCE_ROOT", "1")  # (as --allow-root does, without leaving it set)
    loads: list[object] = []
    build_all = plugins.build_all
    monkeypatch.setattr(plugins, "build_all", lambda args: loads.append(args) or build_all(args))
    argv = ["worker", "--modality", "llm", "--redis-url", "redis://:hush@127.0.0.1:1/0", "--redis-wait-s", "0"]
    err = _fails(argv, capsys)
    assert "cannot reach Redis at 127.0.0.1:1/0 (--redis-url)" in err and "hush" not in err and not loads
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/11", socket_connect_timeout=1).ping()
    except redis.exceptions.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    err = _fails(["worker", "--modality", "llm", "--redis-url", "redis://127.0.0.1:6379/99"], capsys)
    assert "Redis at 127.0.0.1:6379/99 refused the worker" in err and not loads  # (at once, not after 30 s)
    err = _fails(["worker", "--modality", "diffusion", "--redis-url", "redis://127.0.0.1:6379/11"], capsys)
    assert "--modality diffusion: give --image or --video" in err and len(loads) == 1
