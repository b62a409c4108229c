"""The writing target's chat language (testbed/tiny_tasks.py): seeded, prompt-dependent, mostly computed
answers, and a chat template whose layouts differ in what surrounds the turns while the assistant mask still
marks exactly the answer."""

import random

from fledge.testbed import tiny_tasks


def test_seeded_and_prompt_dependent():
    a = [tiny_tasks.conversation(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]
    convs = [tiny_tasks.conversation(random.Random(s), "chat") for s in range(200)]
    users = {c["messages"][-2]["content"]: c["messages"][-1]["content"] for c in convs}
    assert len(set(users.values())) > 150  # different prompts, different answers


def test_answers_mostly_computed():
    """Prompt lookup would copy: most answer words must not appear in the prompt."""
    new = total = 0
    for s in range(300):
        msgs = tiny_tasks.conversation(random.Random(s), "chat")["messages"]
        prompt = set(" ".join(m["content"] for m in msgs[:-1]).replace(",", " ").split())
        words = msgs[-1]["content"].replace(",", " ").split()
        new += sum(w not in prompt for w in words)
        total += len(words)
    assert new / total > 0.4


def test_layouts_change_the_scaffolding_only(tmp_path):
    """Each layout renders the same turns in other scaffolding; under every one the assistant mask marks
    exactly the answers (what a drafter learns and the target's loss is measured on)."""
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_writer

    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer(tmp_path))
    conv = tiny_tasks.conversation(random.Random(5), system=True)
    answers = "".join(m["content"] + "<|end|>" for m in conv["messages"] if m["role"] == "assistant")
    texts = set()
    for lay in tiny_tasks.LAYOUTS:
        enc = tok.apply_chat_template(conv["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                      layout=lay)
        texts.add(tok.decode(enc["input_ids"]))
        marked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
        assert tok.decode(marked) == answers, lay
    assert len(texts) == len(tiny_tasks.LAYOUTS)
    default = tok.apply_chat_template(conv["messages"], tokenize=False)
    assert default == tok.apply_chat_template(conv["messages"], tokenize=False, layout=tiny_tasks.DEFAULT_LAYOUT)


def test_stream_mixes_long_tables_and_context_prefixed_questions():
    """The target's stream holds long tables and questions after other tasks' answers (the main job's long
    prompts), each answering the question it ends with."""
    rng = random.Random(0)
    convs = [tiny_tasks.mixed(rng) for _ in range(400)]
    firsts = [next(m["content"] for m in c["messages"] if m["role"] == "user") for c in convs]
    tables = [f for f in firsts if f.startswith("Table:") and f.count("\n") > 12]
    contexts = [f for f in firsts if f.startswith("Context:\n")]
    assert 0.04 < len(tables) / 400 < 0.14 and 0.07 < len(contexts) / 400 < 0.18
    conv = tiny_tasks.conversation(random.Random(9), "chat")
    ctx = tiny_tasks.with_context(random.Random(1), conv, 3)
    assert ctx["messages"][-1] == conv["messages"][-1]
    assert ctx["messages"][0]["content"].endswith("\n\n" + conv["messages"][0]["content"])


def test_packed_rows_weigh_answers_only(tmp_path):
    """The writer's training rows: the loss mask marks exactly the answer tokens (targets shifted by one),
    and a long table fits one 512-token window."""
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_writer

    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer(tmp_path))
    convs = iter([tiny_tasks.conversation(random.Random(s), "chat") for s in range(200)])
    ids, mask = next(tiny_writer._batches(tok, convs, 128, 2))
    assert ids.shape == (2, 129) and mask.shape == (2, 128)
    text = tok.decode(ids[0, 1:][mask[0].bool()])
    assert 0 < mask.float().mean() < 0.7 and text.count("<|end|>") >= 1 and "Sort by" not in text
    rows = tiny_writer.LONG_EVAL_ROWS[1]
    long = tiny_tasks.long_conversation(random.Random(2), rows)
    n = len(tok(tok.apply_chat_template(long["messages"], tokenize=False))["input_ids"])
    assert n <= tiny_writer.BUDGET["seq_len"], n


def test_pairs_sharing():
    from fledge.testbed import tiny_writer

    assert tiny_writer._pairs_sharing(["a", "b", "c"]) == 0
    assert tiny_writer._pairs_sharing(["a", "a", "b", "b"]) == 2 / 6


def test_masked_loss_weighs_only_marked_targets(capsys):
    """train_target's ``(ids, mask)`` batches: an all-ones mask logs the plain mean cross-entropy of the
    untrained model; a mask that marks one target only gives another loss and another step."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from fledge.testbed import tiny_target

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    one = torch.zeros(2, 16, dtype=torch.long)
    one[0, 3] = 1

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)

    def step(mask):
        model = tiny_target.train_target(fresh(), iter([(x, mask)]), steps=1, lr=1e-2, warmup=1)
        loss = float(capsys.readouterr().out.split(" loss ")[1].split()[0])
        return loss, torch.cat([p.detach().flatten() for p in model.parameters()])

    with torch.no_grad():
        plain = F.cross_entropy(fresh()(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()).item()
    (ones_loss, ones), (one_loss, one_step) = step(torch.ones(2, 16, dtype=torch.long)), step(one)
    assert abs(ones_loss - plain) < 1e-3
    assert abs(one_loss - plain) > 1e-3 and not torch.allclose(one_step, ones, atol=1e-4)
