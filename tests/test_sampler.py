"""Sampling: seeded reproducibility independent of the batch, logits processors (bias,
min_tokens, penalties), truncation filters, logprobs against transformers, and n>1 forks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.sampler import Sampler, _process_row, _truncated_probs, vocab_subset
from engine.sampling_params import SamplingParams
from engine.sequence import PromptInputs, Sequence

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
PROMPT = "Once upon a time, a small llama"
OTHER_PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog and then", "1 2 3 4 5 6 7 8 9 10 11 12 13"]


def _sampled(seed: int | None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), max_model_len=MAX_MODEL_LEN)


def _engine(loaded: LoadedModel, **config) -> LLMEngine:
    cfg = dict(model=str(loaded.path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_BLOCKS, block_size=16)
    return LLMEngine(EngineConfig(**{**cfg, **config}), loaded=loaded)


def _tokens(engine: LLMEngine, prompt, params: SamplingParams) -> list[int]:
    (out,) = engine.generate([prompt], params)
    return out.outputs[0].token_ids


def _assert_kv_all_free(engine: LLMEngine) -> None:
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


# -- (a) seeded sampling is batch-invariant ------------------------------------------------------
def test_seeded_sampling_independent_of_batch(loaded) -> None:
    alone = _tokens(_engine(loaded), PROMPT, _sampled(seed=1234))
    assert len(alone) == 10

    engine = _engine(loaded, max_num_batched_tokens=32)  # chunked prefill mixes prompts and decodes
    prompts = [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1], OTHER_PROMPTS[2], OTHER_PROMPTS[1]]
    params = [
        _greedy(7),
        _sampled(seed=1234),
        _sampled(seed=None, max_tokens=14),
        _greedy(12),
        _sampled(seed=99, max_tokens=5),
    ]
    outs = engine.generate(prompts, params)
    assert outs[1].outputs[0].token_ids == alone
    # The greedy neighbours are unaffected by the sampled ones too.
    assert outs[0].outputs[0].token_ids == _tokens(_engine(loaded), OTHER_PROMPTS[0], _greedy(7))

    # Same seed again on the same engine: same tokens; different seeds: different tokens.
    assert _tokens(engine, PROMPT, _sampled(seed=1234)) == alone
    others = [_tokens(engine, PROMPT, _sampled(seed=s)) for s in (1, 2)]
    assert others[0] != alone and others[1] != alone and others[0] != others[1]
    # And sampling really samples: it is not just the greedy continuation.
    assert alone != _tokens(engine, PROMPT, _greedy(10))


# -- (b) top_k=1 is greedy -----------------------------------------------------------------------
def test_top_k_one_equals_greedy(loaded) -> None:
    engine = _engine(loaded)
    greedy = _tokens(engine, PROMPT, _greedy(12))
    for seed in (None, 7):
        params = SamplingParams(temperature=1.3, top_k=1, seed=seed, max_tokens=12, ignore_eos=True)
        assert _tokens(engine, PROMPT, params) == greedy


# -- (b2) allowed_token_ids: logits of the allowed columns only -----------------------------------
ALLOWED = [901, 5, 17, 300, 301, 999, 17]  # unsorted, with a repeat


@pytest.mark.parametrize("arch", ["llama", "gemma"])  # the fast decoder's own head; the generic one
def test_subset_logits_equal_the_full_logits_columns(tiny_model_dir, arch: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir(arch)), max_model_len=64, num_kv_blocks=8))
    model = engine.runner.model
    subset = vocab_subset(tuple(ALLOWED))
    assert subset.ids == tuple(sorted(set(ALLOWED)))
    hidden = torch.randn(3, model.hidden_size, generator=torch.Generator().manual_seed(0))
    full = model.compute_logits(hidden)
    torch.testing.assert_close(model.compute_logits_for(hidden, subset), full[:, subset.index], atol=1e-5, rtol=1e-5)


def test_allowed_token_ids_rows_sample_only_allowed_ids_whatever_shares_the_batch(loaded) -> None:
    engine = _engine(loaded)
    seeded = SamplingParams(temperature=1.5, seed=5, max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED)
    greedy = _greedy(12, allowed_token_ids=ALLOWED)
    alone = [_tokens(engine, PROMPT, p) for p in (seeded, greedy)]
    assert all(set(t) <= set(ALLOWED) for t in alone) and alone[0] != alone[1]
    # Mixed with full-vocabulary rows (the sampler groups rows by the logits they need).
    outs = engine.generate([OTHER_PROMPTS[1], PROMPT, PROMPT], [_sampled(seed=1), seeded, greedy])
    assert [o.outputs[0].token_ids for o in outs[1:]] == alone
    # The greedy subset row is the argmax of the full logits restricted to the allowed ids.
    masked = Sampler(eos_token_ids=set())
    logits = torch.randn(4, engine.runner.model.vocab_size, generator=torch.Generator().manual_seed(1))
    seqs = [_seq([0], [], temperature=0.0, allowed_token_ids=ALLOWED) for _ in range(4)]
    expected = [ALLOWED[int(i)] for i in logits[:, ALLOWED].argmax(-1)]
    assert [t for t, _ in masked(logits, seqs)] == expected  # the full-vocabulary path
    subset = vocab_subset(tuple(ALLOWED))
    assert [t for t, _ in masked(logits[:, subset.index], seqs, subset)] == expected
    # Rows asking for logprobs (over the whole vocabulary) still only pick allowed ids.
    with_logprobs = SamplingParams(**{**vars(seeded), "logprobs": 2})
    out = engine.generate([PROMPT], with_logprobs)[0].outputs[0]
    assert set(out.token_ids) <= set(ALLOWED) and len(out.logprobs) == 12


# -- (c) logit_bias --------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans(loaded) -> None:
    engine = _engine(loaded)
    greedy = _tokens(engine, PROMPT, _greedy(6))
    forced = 4242
    assert forced not in greedy
    assert _tokens(engine, PROMPT, _greedy(6, logit_bias={forced: 100.0})) == [forced] * 6
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0})
    assert _tokens(engine, PROMPT, sampled) == [forced] * 6

    banned = _tokens(engine, PROMPT, _greedy(6, logit_bias={greedy[0]: -100.0}))
    assert banned[0] != greedy[0]
    assert greedy[0] not in banned


# -- (d) min_tokens ----------------------------------------------------------------------------------
def test_min_tokens_defers_stop_token_ids(loaded) -> None:
    engine = _engine(loaded)
    first = _tokens(engine, PROMPT, _greedy(8))[0]

    # Without min_tokens the greedy next token stops the request at once.
    (out,) = engine.generate([PROMPT], _greedy(8, stop_token_ids=[first]))
    o = out.outputs[0]
    assert o.token_ids == [first] and o.finish_reason == "stop" and o.stop_reason == first

    # With min_tokens=4 it is banned for the first 4 tokens, even when biased to win ...
    params = _greedy(12, stop_token_ids=[first], min_tokens=4, logit_bias={first: 30.0})
    (out,) = engine.generate([PROMPT], params)
    o = out.outputs[0]
    assert first not in o.token_ids[:4]
    # ... then allowed: the bias makes it the 5th token, which ends the request.
    assert len(o.token_ids) == 5 and o.token_ids[-1] == first
    assert o.finish_reason == "stop" and o.stop_reason == first

    # Unbiased: the first token is no longer the greedy one.
    (out,) = engine.generate([PROMPT], _greedy(8, stop_token_ids=[first], min_tokens=3))
    assert first not in out.outputs[0].token_ids[:3]


def test_min_tokens_defers_eos(loaded) -> None:
    engine = _engine(loaded)
    (eos,) = engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={eos: 50.0})
    (out,) = engine.generate([PROMPT], params)
    o = out.outputs[0]
    assert eos not in o.token_ids[:3]
    assert o.token_ids[3:] == [eos] and o.finish_reason == "stop" and o.stop_reason is None
    # ignore_eos: EOS neither stops nor is banned.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={eos: 50.0})
    (out,) = engine.generate([PROMPT], params)
    assert out.outputs[0].token_ids == [eos] * 4 and out.outputs[0].finish_reason == "length"
    _assert_kv_all_free(engine)


# -- (e) penalties on a hand-made row ------------------------------------------------------------------
def _seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", 0, PromptInputs(prompt), SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


def _row() -> torch.Tensor:
    return torch.tensor([2.0, -1.0, 3.0, -4.0, 0.5, 1.5, -0.5, 0.0])


def test_repetition_penalty_row() -> None:
    seq = _seq([0, 1], [2, 3, 3], repetition_penalty=2.0)
    row = _row()
    _process_row(row, seq, eos_token_ids=set())
    # Seen tokens (prompt and output alike): positive logits halved, negative ones doubled.
    expected = torch.tensor([1.0, -2.0, 1.5, -8.0, 0.5, 1.5, -0.5, 0.0])
    torch.testing.assert_close(row, expected)


def test_frequency_and_presence_penalties_row() -> None:
    seq = _seq([4, 5], [0, 0, 0, 1, 6], frequency_penalty=0.5)
    row = _row()
    _process_row(row, seq, eos_token_ids=set())
    # count * penalty per output token; prompt tokens 4 and 5 untouched.
    expected = _row() - torch.tensor([1.5, 0.5, 0, 0, 0, 0, 0.5, 0])
    torch.testing.assert_close(row, expected)

    seq = _seq([4, 5], [0, 0, 0, 1, 6], presence_penalty=0.25, frequency_penalty=-0.5)
    row = _row()
    _process_row(row, seq, eos_token_ids=set())
    expected = _row() - torch.tensor([-1.25, -0.25, 0, 0, 0, 0, -0.25, 0])
    torch.testing.assert_close(row, expected)

    # No output yet: nothing to penalise.
    seq = _seq([0, 1], [], presence_penalty=1.0, frequency_penalty=1.0)
    row = _row()
    _process_row(row, seq, eos_token_ids=set())
    torch.testing.assert_close(row, _row())


def test_bias_and_min_tokens_row() -> None:
    seq = _seq([0], [3], logit_bias={4: 10.0, 1: -1.0}, min_tokens=3, stop_token_ids=[6])
    row = _row()
    _process_row(row, seq, eos_token_ids={7})
    assert row[4] == 10.5 and row[1] == -2.0
    assert row[6] == -math.inf and row[7] == -math.inf
    assert torch.isfinite(row[[0, 2, 3, 5]]).all()
    # min_tokens reached: nothing is banned any more.
    seq = _seq([0], [3, 3, 3], min_tokens=3, stop_token_ids=[6])
    row = _row()
    _process_row(row, seq, eos_token_ids={7})
    torch.testing.assert_close(row, _row())


def test_penalties_change_the_sampler_choice() -> None:
    sampler = Sampler(eos_token_ids=set())
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 3)
    seqs = [
        _seq([3], [0], temperature=0.0),
        _seq([3], [0], temperature=0.0, repetition_penalty=2.0),  # 5 -> 2.5 < 4
        _seq([3], [0, 0, 0], temperature=0.0, frequency_penalty=0.5),  # 5 - 1.5 = 3.5 < 4
    ]
    assert [t for t, _ in sampler(logits, seqs)] == [0, 1, 1]
    torch.testing.assert_close(logits, torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 3))  # input untouched


# -- (g) truncation filters on a hand-made row ---------------------------------------------------------
PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted order: 1, 3, 2, 0


def _filtered(logits: torch.Tensor | None = None, **params) -> torch.Tensor:
    """One row's filtered probabilities (of PROBS by default) under ``SamplingParams(**params)``."""
    row = PROBS.log() if logits is None else logits
    return _truncated_probs(row[None], [SamplingParams(**params)])[0]


def test_truncate_top_p() -> None:
    torch.testing.assert_close(_filtered(), PROBS)
    # Keeps the smallest set whose mass reaches top_p: 0.5 alone < 0.7, 0.5 + 0.3 covers it.
    torch.testing.assert_close(_filtered(top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(_filtered(top_p=0.85), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    torch.testing.assert_close(_filtered(top_p=0.3), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_truncate_min_p_top_k_temperature() -> None:
    # min_p 0.5 of the top probability 0.5: threshold 0.25 keeps tokens 1 and 3.
    torch.testing.assert_close(_filtered(min_p=0.5), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(_filtered(min_p=0.2), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    torch.testing.assert_close(_filtered(top_k=3), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    torch.testing.assert_close(_filtered(top_k=1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # Temperature 0.5 squares the probabilities (before renormalising).
    sq = PROBS**2
    torch.testing.assert_close(_filtered(temperature=0.5), sq / sq.sum())
    # top_k, then top_p over the renormalised survivors: (0.5, 0.3) / 0.8 -> 0.625 alone < 0.7.
    torch.testing.assert_close(_filtered(top_k=2, top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(_filtered(top_k=2, top_p=0.6), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    """4000 unseeded rows sampled in one batch: each token's share is its filtered probability
    (top_p 0.85 keeps 1, 3, 2 of PROBS) within 4 standard errors, and filtered-out tokens never
    come up; big flat rows (top-p widening past the first 64 candidates) stay inside their set."""
    n = 4000
    sampler = Sampler(eos_token_ids=set())
    seqs = [_seq([0], [1], temperature=1.0, top_p=0.85) for _ in range(n)]
    tokens = torch.tensor([t for t, _ in sampler(PROBS.log().repeat(n, 1), seqs)])
    expected = torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95
    share = torch.bincount(tokens, minlength=4).float() / n
    assert share[0] == 0
    assert ((share - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt()).all(), share
    flat = torch.linspace(0, 1, 5000)  # top_p 0.5 keeps the highest ~1464 logits, far past 64
    keep = _filtered(flat, top_p=0.5) > 0
    picked = [t for t, _ in sampler(flat.repeat(200, 1), [_seq([0], [1], temperature=1.0, top_p=0.5)] * 200)]
    assert all(keep[t] for t in picked) and len(set(picked)) > 100


# -- (f) logprobs --------------------------------------------------------------------------------------
def test_logprobs_match_transformers(loaded) -> None:
    engine = _engine(loaded)
    prompt_ids = loaded.tokenizer(PROMPT).input_ids
    k = 5
    outs = engine.generate(
        [prompt_ids, prompt_ids, prompt_ids],
        [
            _greedy(4, logprobs=k),
            SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True, logprobs=k, repetition_penalty=1.5),
            _greedy(4, logprobs=0),
        ],
    )
    ref = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    for out in outs[:2]:
        o = out.outputs[0]
        assert len(o.logprobs) == len(o.token_ids) == 4
        with torch.inference_mode():
            logits = ref(torch.tensor([prompt_ids + o.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
        for pos, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            assert lp.token_id == tok
            # The model's own distribution: before temperature and penalties.
            assert lp.logprob == pytest.approx(float(expected[pos, tok]), abs=1e-4)
            assert len(lp.top) == k
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            ref_vals, ref_ids = expected[pos].topk(k)
            assert [t for t, _ in lp.top] == ref_ids.tolist()
            assert values == pytest.approx(ref_vals.tolist(), abs=1e-4)
    greedy = outs[0].outputs[0]
    assert all(lp.top[0][0] == t for t, lp in zip(greedy.token_ids, greedy.logprobs, strict=True))
    # logprobs=0: the chosen token's logprob only.
    zero = outs[2].outputs[0]
    assert zero.token_ids == greedy.token_ids
    assert [lp.top for lp in zero.logprobs] == [[]] * 4
    assert [lp.logprob for lp in zero.logprobs] == pytest.approx([lp.logprob for lp in greedy.logprobs], abs=1e-5)
    # No logprobs requested: none reported.
    assert _engine(loaded).generate([prompt_ids], _greedy(2))[0].outputs[0].logprobs is None


# -- (h) n > 1 -----------------------------------------------------------------------------------------
def test_n_seeded_samples_distinct_and_reproducible(loaded) -> None:
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = _engine(loaded)
        (out,) = engine.generate([PROMPT], params)
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
        runs.append([o.token_ids for o in out.outputs])
        _assert_kv_all_free(engine)
    assert runs[0] == runs[1]
    samples = runs[0]
    assert len({tuple(s) for s in samples}) == 3


@pytest.mark.parametrize("prompt_len", [21, 32])  # partial last block (copy-on-write) and a full one
def test_n_greedy_identical_and_kv_freed(loaded, prompt_len: int) -> None:
    engine = _engine(loaded)
    prompt = list(range(1000, 1000 + prompt_len))
    single = _tokens(engine, prompt, _greedy(20))
    (out,) = engine.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in out.outputs] == [single, single]
    assert out.outputs[0].text == out.outputs[1].text
    _assert_kv_all_free(engine)
