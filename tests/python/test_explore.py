"""`mha explore` (issue 16) as a user and a client see it: the server runs as a subprocess on a free
loopback port (tests/python/explore_server.py) with the checkpoint of a short demo run.

What is checked, each against something computed apart from the server's own answer:
- the translation and its checks equal what `mha translate` prints for the same input and checkpoint;
- the maps have the input's characters on their axes, rows that sum to 1, and the decoder's masked
  self-attention sees no later position;
- with heads switched off, the answer, the maps and the held-out accuracy equal those of a checkpoint in
  which this test zeroed those heads' columns of W^O (Concat(head_1..head_h) W^O without their blocks);
- with no head off, the held-out accuracy is the one `mha demo` stored in the checkpoint;
- bad requests get 400 / 404 / 405 / 413 with a message naming the problem, and the server goes on;
- 16 clients at once get the answers one client gets alone; a client that hangs up mid-request harms
  nothing; SIGINT and SIGTERM stop the server with status 0; the load script runs without errors.
"""
import concurrent.futures
import json
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from mha import read_safetensors, write_safetensors

from explore_server import MHA, ROOT, explore_server, request

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")

INPUTS = ["Friday, 5 March 2021", "05/03/2021", "the fifth of March 2021", "31 February 2021", "1999-12-31",
          "5 mar 21", "20210305", "  march   5th, 2021. "]
# One head of each kind (layer, kind, head), switched off together.
HEADS_OFF = [[0, "encoder_self", 1], [1, "decoder_self", 0], [0, "cross", 1]]


@pytest.fixture(scope="module")
def server(explore_checkpoint):
    with explore_server(explore_checkpoint) as (base, _):
        yield base


def post(base, path, body):
    return request(base, "POST", path, body)


def translate(base, text, heads_off=()):
    status, answer = post(base, "/api/translate", {"text": text, "heads_off": list(heads_off)})
    assert status == 200, answer
    return answer


# ---- the page and the model -----------------------------------------------------------------------

def test_the_page_its_script_and_style_are_served_from_the_binary(server):
    status, html = request(server, "GET", "/")
    assert status == 200 and "<title>mha explore" in html
    assert 'src="/explore.js"' in html and 'href="/explore.css"' in html
    for path in ("/explore.js", "/explore.css"):
        status, text = request(server, "GET", path)
        assert status == 200 and len(text) > 500, path
        assert "http://" not in text and "https://" not in text, f"{path} refers to another site"
    assert "http://" not in html and "https://" not in html


def test_model_describes_the_checkpoint(server, explore_checkpoint):
    _, metadata = read_safetensors(str(explore_checkpoint))
    status, model = request(server, "GET", "/api/model")
    assert status == 200
    assert (model["encoder_layers"], model["decoder_layers"], model["heads"]) == (2, 2, 2)
    assert [k["kind"] for k in model["kinds"]] == ["encoder_self", "decoder_self", "cross"]
    assert model["held_out_examples"] == int(metadata["held_out_examples"]) == 100
    assert model["unsure_below"] == pytest.approx(float(metadata["unsure_below"]))


# ---- answers ---------------------------------------------------------------------------------------

def test_translation_and_checks_equal_mha_translate(server, explore_checkpoint):
    printed = subprocess.run([str(MHA), "translate", "--checkpoint", str(explore_checkpoint), *INPUTS],
                             capture_output=True, text=True)
    assert printed.returncode in (0, 3), printed.stderr
    lines = printed.stdout.splitlines()
    assert len(lines) == len(INPUTS)
    for text, line in zip(INPUTS, lines):
        answer = translate(server, text)
        assert answer["line"] == line, text
        assert line.endswith(answer["translation"]) or line.startswith(f"? {answer['translation']}  ")
        assert answer["valid"] == (not line.startswith("?") or "low confidence" in line)
        assert 0.0 < answer["confidence"] <= 1.0
        assert answer["input"] == text


def labels_of(text):
    return ["_" if c == " " else c for c in text]


def test_maps_have_the_characters_on_their_axes_and_are_attention_weights(server):
    answer = translate(server, "Fri, 5 Mar 21")
    source = labels_of(answer["normalized"])
    target = ["^"] + list(answer["translation"])[:10]
    maps = {m["kind"]: m for m in answer["maps"]}
    assert maps["encoder_self"]["queries"] == source and maps["encoder_self"]["keys"] == source
    assert maps["cross"]["keys"] == source
    assert maps["cross"]["queries"][: len(target)] == target and len(maps["cross"]["queries"]) == 11
    assert maps["decoder_self"]["queries"] == maps["decoder_self"]["keys"] == maps["cross"]["queries"]
    for kind, m in maps.items():
        w = np.array(m["layers"])  # [layers, h, L, S]
        assert w.shape == (2, 2, len(m["queries"]), len(m["keys"])), kind
        assert np.all(w >= 0) and np.allclose(w.sum(-1), 1, atol=5e-4 * w.shape[-1]), kind  # 4 decimals each
    causal = np.array(maps["decoder_self"]["layers"])
    assert np.all(np.triu(np.ones((11, 11)), 1)[None, None] * causal == 0), "a position saw a later one"


def checkpoint_without(explore_checkpoint, folder, heads_off):
    """The checkpoint with each head's columns of its block's out_proj.weight [E, h*d_v] set to 0."""
    tensors, metadata = read_safetensors(str(explore_checkpoint))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    heads = int(metadata["heads"])
    for layer, kind, head in heads_off:
        name = {"encoder_self": f"encoder.{layer}.self_attn", "decoder_self": f"decoder.{layer}.self_attn",
                "cross": f"decoder.{layer}.cross_attn"}[kind] + ".out_proj.weight"
        d_v = tensors[name].shape[1] // heads
        tensors[name][:, head * d_v:(head + 1) * d_v] = 0
    path = folder / "zeroed.safetensors"
    write_safetensors(str(path), tensors, metadata)
    return path


def test_heads_off_equal_a_checkpoint_with_their_blocks_of_wo_zeroed(server, explore_checkpoint, tmp_path):
    zeroed = checkpoint_without(explore_checkpoint, tmp_path, HEADS_OFF)
    with explore_server(zeroed) as (by_hand, _):
        changed = False
        for text in INPUTS[:4]:
            plain, off, expected = translate(server, text), translate(server, text, HEADS_OFF), translate(by_hand, text)
            assert sorted(map(tuple, off["heads_off"])) == sorted(map(tuple, HEADS_OFF))
            assert off["translation"] == expected["translation"] and off["line"] == expected["line"], text
            assert off["confidence"] == pytest.approx(expected["confidence"], rel=1e-5, abs=1e-6)
            for got, want in zip(off["maps"], expected["maps"]):
                np.testing.assert_allclose(got["layers"], want["layers"], atol=2e-4)
            changed = changed or off["confidence"] != plain["confidence"]
        assert changed, "switching the heads off changed no confidence"
        status, accuracy_off = post(server, "/api/accuracy", {"heads_off": HEADS_OFF})
        assert status == 200
        status, accuracy_by_hand = post(by_hand, "/api/accuracy", {})
        assert status == 200 and accuracy_off["correct"] == accuracy_by_hand["correct"]


def test_accuracy_with_every_head_on_is_the_demos_and_is_cached(server, explore_checkpoint):
    _, metadata = read_safetensors(str(explore_checkpoint))
    status, first = post(server, "/api/accuracy", {"heads_off": []})
    assert status == 200
    assert first["examples"] == 100 and first["accuracy"] == pytest.approx(first["correct"] / 100)
    assert metadata["held_out_exact_match"] == f"{first['accuracy']:.4f}"  # stored with 4 decimals
    status, again = post(server, "/api/accuracy", {})  # the same (empty) head set, asked differently
    assert status == 200 and again["cached"] and again["correct"] == first["correct"]
    heads = [[1, "cross", 0], [0, "cross", 0]]
    status, off = post(server, "/api/accuracy", {"heads_off": heads})
    status_again, off_again = post(server, "/api/accuracy", {"heads_off": heads[::-1]})  # any order: one set
    assert status == status_again == 200 and not off["cached"] and off_again["cached"]
    assert off_again["correct"] == off["correct"] and 0 <= off["accuracy"] <= 1


def test_clients_asking_at_once_for_one_new_head_set_share_one_computation(server):
    heads = [[1, "encoder_self", 0], [1, "cross", 1]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(server, "/api/accuracy", {"heads_off": heads}), range(8)))
    assert all(status == 200 for status, _ in answers)
    assert sorted(a["cached"] for _, a in answers) == [False] + [True] * 7  # computed once, the others waited
    assert len({a["correct"] for _, a in answers}) == 1


# ---- bad requests ----------------------------------------------------------------------------------

BAD_BODIES = [
    (b"{\"text\": ", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"{}", "\"text\": expected a string"),
    (b"{\"text\": 5}", "\"text\": expected a string"),
    (b"{\"text\": \"   \"}", "the input is empty"),
    (json.dumps({"text": "5" * 65}).encode(), "the input has 65 characters; at most 64"),
    (json.dumps({"text": "5 March 2021 #"}).encode(), "'#'"),
    (json.dumps({"text": "5 M\u00e4rz 2021"}).encode(), "not in the vocabulary"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": 3}", "heads_off: expected an array"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"cross\"]]}", "heads_off[0]: expected [layer, kind, head]"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"decoder\", 1]]}", "unknown kind \"decoder\""),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[2, \"cross\", 1]]}", "layer 2 is outside 0..1"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"cross\", -1]]}", "head -1 is outside 0..1"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"cross\", 1.5]]}", "head must be an integer"),
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"cross\", 1], [18446744073709551615, \"cross\", 0]]}",
     "heads_off[1]: layer 18446744073709551615 is outside"),
    (b"{\"text\": 1e400}", "\"text\": the number 1e400 is out of range"),  # a double's overflow (issue 30)
    (b"{\"text\": \"5 March 2021\", \"heads_off\": [[0, \"cross\", 1e400]]}",
     "heads_off[0][2]: the number 1e400 is out of range"),
]


@pytest.mark.parametrize("body, message", BAD_BODIES, ids=[m for _, m in BAD_BODIES])
def test_a_bad_request_gets_400_naming_the_problem(server, body, message):
    status, answer = request(server, "POST", "/api/translate", raw=body)
    assert status == 400 and message in answer["error"], answer


def test_bad_heads_of_an_accuracy_request_get_400(server):
    status, answer = post(server, "/api/accuracy", {"heads_off": [[0, "encoder_self", 2]]})
    assert status == 400 and "head 2 is outside 0..1" in answer["error"]


def test_oversize_bodies_unknown_paths_and_methods(server):
    status, answer = request(server, "POST", "/api/translate", raw=json.dumps({"text": "x" * 20000}).encode())
    assert status == 413 and "over 16384 bytes" in answer["error"]
    status, answer = request(server, "GET", "/api/nothing")
    assert status == 404 and "no such path: GET /api/nothing" in answer["error"]
    status, answer = request(server, "GET", "/api/translate")
    assert status == 405 and "POST" in answer["error"]
    assert translate(server, "5 March 2021")["translation"]  # and the server goes on


# ---- many clients, clients that leave, stopping ----------------------------------------------------

def test_sixteen_clients_at_once_get_what_one_client_gets(server):
    cases = [(text, heads) for text in INPUTS for heads in ([], HEADS_OFF[:1], HEADS_OFF)]
    alone = {(text, json.dumps(heads)): translate(server, text, heads) for text, heads in cases}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda case: translate(server, *case), cases * 2))
    for (text, heads), answer in zip(cases * 2, answers):
        expected = alone[(text, json.dumps(heads))]
        assert (answer["line"], answer["confidence"], answer["maps"]) == \
            (expected["line"], expected["confidence"], expected["maps"]), text


def test_a_client_that_hangs_up_mid_request_harms_nothing(server):
    host, port = server.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"text": "the fifth of March 2021", "heads_off": [[1, "encoder_self", 1]]}).encode()
    for sent in (body[: len(body) // 2], body):  # half a body; a whole one, then gone before the answer
        for path in ("/api/translate", "/api/accuracy"):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + sent)
    answer = translate(server, "the fifth of March 2021", [[1, "encoder_self", 1]])
    assert answer == translate(server, "the fifth of March 2021", [[1, "encoder_self", 1]])
    status, accuracy = post(server, "/api/accuracy", {"heads_off": [[1, "encoder_self", 1]]})
    assert status == 200 and 0 <= accuracy["accuracy"] <= 1


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_with_status_0(explore_checkpoint, stop):
    with explore_server(explore_checkpoint, stop=stop) as (base, process):
        assert translate(base, "5 March 2021")["translation"]
    # explore_server checked the exit status (0) and the "stopped" line after the signal


def test_another_host_than_loopback_is_warned_about(explore_checkpoint):
    with explore_server(explore_checkpoint, "--host", "0.0.0.0") as (base, process):
        status, _ = request(base.replace("0.0.0.0", "127.0.0.1"), "GET", "/api/model")
        assert status == 200
    # the warning is on standard error, which explore_server has read to its end by now
    assert "not on loopback" in process.stderr_text


def test_a_port_in_use_is_named(server, explore_checkpoint):
    port = server.rsplit(":", 1)[1]
    result = subprocess.run([str(MHA), "explore", "--checkpoint", str(explore_checkpoint), "--port", port],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr


def test_a_missing_checkpoint_is_named_with_what_to_do(tmp_path):
    result = subprocess.run([str(MHA), "explore", "--checkpoint", str(tmp_path / "none.safetensors"), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no checkpoint at" in result.stderr and "mha demo" in result.stderr


def test_the_load_script_runs_without_errors(server):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "explore-load.py"), server, "--requests", "200",
                             "--clients", "16", "--time-limit", "120"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "errors 0" in result.stdout, result.stdout
