"""Feature store: the capture stage on a fake run dir, read back through FeatureStore / FeatureLoader.

Checks the stored states against the target, the fp8 error bound, resumption after losing shards,
lazy checksums naming the shard, manifest mismatches, and the loader's rank split and exact resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from fledge.conf.schema import Config
from fledge.data.features.reader import FeatureLoader, FeatureStore
from fledge.data.features.store import INDEX, STORE_MANIFEST, bytes_per_token
from fledge.distributed import World
from fledge.models.target import FrozenTarget
from fledge.pipeline.runner import StageContext
from fledge.pipeline.stages import capture as run_stage, capture_inputs
from fledge.run_layout import RunLayout

L, H, V, IDS = 6, 32, 96, [2, 3, 4]
N_TRAIN, N_EVAL = 14, 4


def make_target(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
                     ).save_pretrained(path)


def make_prepared(run_dir: Path, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    for split, n in (("train", N_TRAIN), ("eval", N_EVAL)):
        lens = torch.randint(3, 40, (n,), generator=g).tolist()
        ids = [torch.randint(0, V, (k,), generator=g).int().tolist() for k in lens]
        mask = [torch.randint(0, 2, (k,), generator=g).to(torch.int8).tolist() for k in lens]
        Dataset.from_dict({"input_ids": ids, "loss_mask": mask}).save_to_disk(str(run_dir / "prepare" / split))


def make_cfg(root: Path, name: str, dtype="bf16", shard_kb=8) -> Config:
    cfg = Config()
    cfg.recipe = "test"
    cfg.run.name, cfg.run.output_root = name, str(root)
    t = cfg.target
    t.name_or_path, t.dtype, t.num_hidden_layers, t.hidden_size, t.vocab_size = str(root / "target"), "float32", L, H, V
    cfg.drafter.aux_layer_ids, cfg.drafter.draft_vocab_size = list(IDS), 64
    cfg.capture.dtype, cfg.capture.batch_tokens = dtype, 64
    cfg.capture.shard_size_mb = shard_kb / 1024  # fractional MiB: tiny shards so every split has several
    return cfg.validate()


def capture(cfg: Config) -> Path:
    run_dir = Path(cfg.run.output_root) / cfg.run.name
    world = World(0, 1, 0, torch.device("cpu"))
    up = {"prepare": {"inputs_hash": "x", "complete": True}}
    ctx = StageContext(capture_inputs(cfg), world, RunLayout(run_dir), "capture", up)
    ctx.stage_dir.mkdir(parents=True, exist_ok=True)
    out = run_stage(ctx)
    assert out["train_samples"] == N_TRAIN and out["eval_samples"] == N_EVAL
    return ctx.stage_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("feat")
    make_target(root / "target")
    for name in ("bf16", "fp8"):
        make_prepared(root / name)
    return root


@pytest.fixture(scope="module")
def bf16_store(root):
    return capture(make_cfg(root, "bf16"))


def _reference(root, store, i):
    from datasets import load_from_disk

    row = load_from_disk(str(store.parent.parent / "prepare" / "train"))[i]
    tcfg = make_cfg(root, "bf16").target
    target = FrozenTarget.load(tcfg, torch.device("cpu"), IDS)
    aux, final, argmax = target.capture(torch.tensor([row["input_ids"]]))
    return row, aux[0], final[0], argmax[0]


def test_store_matches_target(root, bf16_store):
    store = FeatureStore(bf16_store / "train")
    m = store.manifest
    assert len(store) == N_TRAIN and store.sample_ids == list(range(N_TRAIN)) and len(m["shards"]) > 1
    assert m["aux_layer_ids"] == IDS and m["bytes_per_token"] == bytes_per_token(3, H, "bf16")
    assert m["tokenizer_hash"] and m["prepare_manifest_hash"] and m["target"]["fingerprint"]
    for i in (0, 5, N_TRAIN - 1):
        row, aux, final, argmax = _reference(root, bf16_store / "train", i)
        s = store[i]
        assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.bool
        assert s["input_ids"].tolist() == row["input_ids"] and s["loss_mask"].int().tolist() == row["loss_mask"]
        assert s["aux_hidden"].shape == (len(row["input_ids"]), 3 * H)
        # bf16 storage of fp32 states captured in a padded batch vs alone: bf16 rounding only
        torch.testing.assert_close(s["aux_hidden"].float(), aux, rtol=8e-3, atol=1e-4)
        torch.testing.assert_close(s["target_hidden"].float(), final, rtol=8e-3, atol=1e-4)
        assert torch.equal(s["target_argmax"], argmax)
    on_disk = sum(p.stat().st_size for p in (bf16_store / "train").rglob("*.safetensors"))
    payload = m["num_tokens"] * m["bytes_per_token"]
    assert payload <= on_disk < payload + 2048 * len(m["shards"])


def test_fp8_round_trip_error(root, bf16_store):
    """fp8-e4m3 with one scale s = amax/448 per token and aux layer: |err| <= 2^-4 |x| + 2^-10 s per element."""
    store = FeatureStore(capture(make_cfg(root, "fp8", dtype="fp8")) / "train", dtype=torch.float32)
    ref_store = FeatureStore(bf16_store / "train")
    assert store.manifest["bytes_per_token"] < 0.7 * ref_store.manifest["bytes_per_token"]
    rel = []
    for i in range(len(store)):
        _, aux, final, _ = _reference(root, bf16_store / "train", i)
        got = store[i]["aux_hidden"]
        T = aux.shape[0]
        s = aux.view(T, 3, H).abs().amax(-1, keepdim=True) / 448.0
        bound = (2 ** -4 * aux.view(T, 3, H).abs() + 2 ** -10 * s + 1e-6 * s).view(T, -1)
        assert ((got - aux).abs() <= bound).all()
        rel.append(((got - aux).norm() / aux.norm()).item())
        torch.testing.assert_close(store[i]["target_hidden"].float(), final, rtol=8e-3, atol=1e-4)  # bf16 as before
    assert max(rel) < 0.04  # measured ~0.02: the per-token relative RMS error of the aux states


def test_resume_after_lost_shards_is_identical(root, bf16_store, tmp_path):
    snap = {p.relative_to(bf16_store): p.read_bytes() for p in bf16_store.rglob("*") if p.is_file()}
    rdir = bf16_store / "train" / "rank00000"
    index = json.loads((rdir / INDEX).read_text())
    assert len(index["shards"]) >= 3
    # as if killed after writing shard 2 but before indexing it, with shard 1 corrupted on disk
    (rdir / index["shards"][-1]["name"]).unlink()
    index["shards"], index["complete"] = index["shards"][:3], False
    (rdir / INDEX).write_text(json.dumps(index))
    raw = bytearray((rdir / index["shards"][1]["name"]).read_bytes())
    raw[-5] ^= 0xFF
    (rdir / index["shards"][1]["name"]).write_bytes(bytes(raw))
    (bf16_store / "train" / STORE_MANIFEST).unlink()
    capture(make_cfg(root, "bf16"))
    after = {p.relative_to(bf16_store): p.read_bytes() for p in bf16_store.rglob("*") if p.is_file()}
    assert after.keys() == snap.keys() and all(after[k] == snap[k] for k in snap)


def test_flipped_byte_names_the_shard(bf16_store, tmp_path):
    store_dir = tmp_path / "train"
    shutil.copytree(bf16_store / "train", store_dir)
    store = FeatureStore(store_dir)
    shard = store.manifest["shards"][1]["path"]
    victim = next(i for i in range(len(store)) if store._loc[i][0] == shard)
    other = next(i for i in range(len(store)) if store._loc[i][0] != shard)
    raw = bytearray((store_dir / shard).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (store_dir / shard).write_bytes(bytes(raw))
    store = FeatureStore(store_dir)
    store[other]  # other shards still read (checks are lazy, per shard)
    with pytest.raises(ValueError, match=shard.split("/")[-1]):
        store[victim]


def test_manifest_mismatch_refused(root, bf16_store):
    store = FeatureStore(bf16_store / "train")
    cfg = make_cfg(root, "bf16")
    store.check_compatible(cfg.target, cfg.aux_layer_ids())
    with pytest.raises(ValueError, match="drafter.aux_layer_ids"):
        store.check_compatible(cfg.target, [2, 3, 5])
    cfg = make_cfg(root, "bf16")
    cfg.target.name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(ValueError, match="target.name_or_path"):
        FeatureLoader(bf16_store / "train", 0, 1, 64, 2, 0).store.check_compatible(cfg.target, IDS)
    cfg = make_cfg(root, "bf16")
    cfg.target.hidden_size = 2 * H
    with pytest.raises(ValueError, match="target.hidden_size"):
        store.check_compatible(cfg.target, IDS)


def test_loader_ranks_and_exact_resume(bf16_store):
    def ids_of(batch):
        return [tuple(batch.input_ids[r][batch.document_ids[r] == d].tolist())
                for r in range(batch.input_ids.shape[0]) for d in batch.document_ids[r].unique().tolist() if d >= 0]

    loaders = [FeatureLoader(bf16_store / "train", r, 2, 64, 2, seed=3) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) > 0
    seen = [ids_of(b) for ld in loaders for b in ld]
    flat = [s for b in seen for s in b]
    assert len(flat) == len(set(flat))  # no sample on two ranks
    # world-size independence: 2 ranks' batches interleaved == 1 rank's batches in order
    single = FeatureLoader(bf16_store / "train", 0, 1, 64, 2, seed=3)
    two = [FeatureLoader(bf16_store / "train", r, 2, 64, 2, seed=3) for r in range(2)]
    interleaved = [ids_of(b) for pair in zip(*two) for b in pair]
    assert interleaved == [ids_of(b) for b in single][:len(interleaved)]
    ld = FeatureLoader(bf16_store / "train", 0, 2, 64, 2, seed=3)
    full = [ids_of(b) for b in ld] + [ids_of(b) for b in ld]  # epochs 0 and 1
    assert full[:len(full) // 2] != full[len(full) // 2:]  # reshuffled per epoch
    ld = FeatureLoader(bf16_store / "train", 0, 2, 64, 2, seed=3)
    it = iter(ld)
    first = [ids_of(next(it))]
    assert ld.position == 2 and type(ld.position) is int  # the loader's whole state: global batches consumed
    resumed = FeatureLoader(bf16_store / "train", 0, 2, 64, 2, seed=3)
    resumed.seek(ld.position)
    rest = [ids_of(resumed.next_batch()[1]) for _ in range(len(full) - 1)]
    assert first + rest == full
    b = next(iter(FeatureLoader(bf16_store / "train", 0, 1, 64, 2, seed=0)))
    assert b.aux_hidden.shape[-1] == 3 * H and b.target_hidden.shape[-1] == H and b.target_argmax.dtype == torch.int64


def test_online_source_yields_the_offline_batches(root, bf16_store):
    from fledge.data.capture.online import OnlineFeatureSource

    cfg = make_cfg(root, "bf16")
    target = FrozenTarget.load(cfg.target, torch.device("cpu"), cfg.aux_layer_ids())
    online = OnlineFeatureSource(root / "bf16" / "prepare" / "train", target, 0, 1, 64, 2, seed=5)
    offline = FeatureLoader(bf16_store / "train", 0, 1, 64, 2, seed=5, dtype=torch.float32)
    assert len(online) == len(offline)
    for a, b in zip(online, offline):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.document_ids, b.document_ids) and torch.equal(a.target_argmax, b.target_argmax)
        torch.testing.assert_close(a.aux_hidden.float(), b.aux_hidden, rtol=8e-3, atol=1e-4)  # b: bf16 store
        torch.testing.assert_close(a.target_hidden.float(), b.target_hidden, rtol=8e-3, atol=1e-4)
    assert online.position == len(offline)


def test_feature_sources_choose_the_store_the_target_or_the_stream(root, bf16_store, tmp_path):
    """data/capture/sources.py, the one place training's features are chosen: capture.mode=offline reads the store
    (whichever engine made it), online runs the target on the rank (one target for both splits) or streams it from
    vLLM, each on the same batch plan; any other pair of keys is one line naming both."""
    from fledge.data.capture.online import OnlineFeatureSource
    from fledge.data.capture.sources import feature_sources, source_kind

    pairs = [("offline", "hf"), ("offline", "vllm"), ("online", "hf"), ("online", "vllm")]
    assert [source_kind(m, e) for m, e in pairs] == ["store", "store", "hf", "vllm-stream"]
    cfg, layout = make_cfg(root, "bf16"), RunLayout(root / "bf16")
    cfg.train.micro_batch_tokens, cfg.train.micro_batch_size, cfg.run.seed = 64, 2, 5
    one = World(0, 1, 0, torch.device("cpu"))

    def sources(world, **ranks):
        return feature_sources(cfg.target, cfg.capture, cfg.train, cfg.aux_layer_ids(), cfg.run.seed, layout, world,
                               torch.float32, **ranks)

    train, held_out = sources(one)
    assert isinstance(train, FeatureLoader) and (train.store.dir, held_out.store.dir) == (
        bf16_store / "train", bf16_store / "eval")
    cfg.capture.mode = "online"
    live, live_eval = sources(one)
    assert isinstance(live, OnlineFeatureSource) and live.target is live_eval.target
    assert live.global_plan(0) == train.global_plan(0) and len(live_eval) == len(held_out)
    cfg.capture.engine, cfg.capture.engine_python = "vllm", str(tmp_path / "no-python")
    with pytest.raises(ValueError, match=r"^capture.engine=vllm: no engine python at .*no-python; .*setup_engine.sh"):
        sources(one)
    (tmp_path / "no-python").touch()  # an engine that is never started: the set-up's checks come first
    cfg.capture.ranks_per_engine, cfg.train.sequence_parallel = 2, 2
    with pytest.raises(ValueError, match=r"^capture.ranks_per_engine=2 with train.sequence_parallel=2: .*set one to 1"):
        sources(World(0, 2, 0, torch.device("cpu")), rank=0, world_size=1)
    for mode, engine in (("stream", "vllm"), ("online", "sglang")):
        cfg.capture.mode, cfg.capture.engine = mode, engine
        with pytest.raises(ValueError, match=rf"^capture.mode='{mode}' capture.engine='{engine}': no feature source"):
            sources(one)


def test_array_slices_merge_into_one_store(root, bf16_store):
    """3 slices captured one after another (slice 2 by 2 ranks), merged: the plain store's samples."""
    run_dir = root / "sliced"
    shutil.copytree(root / "bf16" / "prepare", run_dir / "prepare")
    cfg = make_cfg(root, "sliced")
    cfg.run.stages, cfg.capture.num_slices = ["capture"], 3
    up = {"prepare": {"inputs_hash": "x", "complete": True}}

    def run(slice_index, world):
        c = make_cfg(root, "sliced")
        c.run.stages, c.capture.num_slices, c.capture.slice_index = ["capture"], 3, slice_index
        return run_stage(StageContext(capture_inputs(c.validate()), world, RunLayout(run_dir), "capture", up))

    out = run(0, World(0, 1, 0, torch.device("cpu")))
    assert out["complete"] is False and out["train_samples"] == N_TRAIN // 3
    for rank in (1, 0):  # rank 0 records the slice once its own part is done: run it last
        run(2, _NoBarrierWorld(rank, 2, rank, torch.device("cpu")))
    merge = StageContext(capture_inputs(cfg.validate()), World(0, 1, 0, torch.device("cpu")), RunLayout(run_dir),
                         "capture", up)
    with pytest.raises(ValueError, match=r"slices 1 have not finished.*sbatch --array=1 .*capture_array.sbatch"):
        run_stage(merge)
    with pytest.raises(ValueError, match="no complete store.json"):
        FeatureStore(run_dir / "capture" / "train")
    run(1, World(0, 1, 0, torch.device("cpu")))
    out = run_stage(merge)
    assert "complete" not in out and out["train_samples"] == N_TRAIN and out["slices"] == 3

    plain, merged = FeatureStore(bf16_store / "train"), FeatureStore(run_dir / "capture" / "train")
    assert "slice00002/rank00001" in merged.manifest["indexes"]
    assert merged.sample_ids == plain.sample_ids == list(range(N_TRAIN)) and merged.lengths == plain.lengths
    for i in range(N_TRAIN):
        a, b = plain[i], merged[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        # other forward batches than the plain run's: fp32 noise, then bf16 rounding
        torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"], rtol=8e-3, atol=1e-4)
        torch.testing.assert_close(a["target_hidden"], b["target_hidden"], rtol=8e-3, atol=1e-4)
    assert len(FeatureStore(run_dir / "capture" / "eval")) == N_EVAL
    loaders = [FeatureLoader(d / "train", 0, 1, 64, 2, seed=3) for d in (bf16_store, run_dir / "capture")]
    assert loaders[0].global_plan(0) == loaders[1].global_plan(0)  # the training batch plan is global


class _NoBarrierWorld(World):
    """Rank r of w with no process group: the test runs the ranks one after another."""

    def barrier(self) -> None:
        pass
