"""What ``algorithm="auto"`` chooses, from tables built here: the rules of ``selection.py``.

No MPI here: choosing is a pure function of the table, the message size and the rank count;
where the table comes from is a matter of files and the environment. (``tests/mpi/test_selection.py``
checks the collective part: rank 0 reads, every rank follows.)
"""
import json
import math
import re

import pytest

from allreduce_kit import ALGORITHMS, config, multinode, online, selection
from allreduce_kit.topology import Topology

A, B, C = "naive", "ring", "tree"


@pytest.fixture(autouse=True)
def no_tuning_from_outside(tmp_path, monkeypatch):
    """Neither the user's $ALLREDUCE_KIT_TUNING nor their ~/.config may reach these tests."""
    monkeypatch.delenv(selection.ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def write_json(path, payload) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return str(path)


# -- choosing from a table ---------------------------------------------------------------------
def test_the_last_rule_at_or_below_the_size_wins_boundaries_exact():
    table = {4: ((0, A), (1024, B), (1 << 20, C))}
    cases = {0: A, 1: A, 1023: A, 1024: B, 1025: B, (1 << 20) - 1: B, 1 << 20: C, 1 << 40: C}
    for nbytes, want in cases.items():
        assert selection.choose(nbytes, 4, table) == want, nbytes


def test_a_measured_rank_count_uses_its_own_rules():
    table = {2: ((0, A),), 3: ((0, B),), 4: ((0, C),)}
    assert [selection.choose(8, p, table) for p in (2, 3, 4)] == [A, B, C]


@pytest.mark.parametrize("size, want", [
    (2, A), (3, A), (5, B), (6, B), (8, B), (11, B), (16, C), (30, C), (1000, C),
])
def test_an_unmeasured_rank_count_uses_the_nearest_on_a_log_scale(size, want):
    """{2, 8, 16} measured: 3 is nearer 2 than 8 (log2 1.58 against 1 and 3), 5 and 6 nearer 8
    than 2 (2.32 and 2.58 against 1 and 3), 11 nearer 8 than 16 (3.46 against 3 and 4); beyond
    the last measured count, the last."""
    table = {2: ((0, A),), 8: ((0, B),), 16: ((0, C),)}
    assert selection.rules_for(table, size) == table[{A: 2, B: 8, C: 16}[want]]
    assert selection.choose(0, size, table) == want


def _log_nearest(table, size):
    """The documented rule, written out: the least |log2 q - log2 size|, ties to the larger q."""
    return min(table, key=lambda q: (round(abs(math.log2(q) - math.log2(size)), 12), -q))


@pytest.mark.parametrize("measured, size", [((2, 8), 4), ((4, 16), 8), ((2, 4), 3), ((4, 8), 6), ((8, 16), 12),
                                           ((2, 4, 8), 3)], ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else f"at{v}")
def test_a_rank_count_between_two_measured_ones_follows_the_log_scale_ties_to_the_larger(measured, size):
    """sqrt(2 * 8) = 4 is as far from 2 as from 8 on a log scale: the larger, 8, wins.
    log2 3 = 1.58 is nearer log2 4 = 2 than log2 2 = 1; log2 12 = 3.58 nearer 4 than 3."""
    table = {q: ((0, name),) for q, name in zip(measured, (A, B, C))}
    assert selection.rules_for(table, size) == table[_log_nearest(table, size)]


def test_choose_without_a_table_uses_the_builtin_one():
    for size in (2, 4, 8):
        for nbytes in (4, 1 << 20, 64 << 20):
            assert selection.choose(nbytes, size) == selection.choose(nbytes, size, selection.BUILTIN)
            assert selection.choose(nbytes, size) in ALGORITHMS


# -- parsing a tuning file ---------------------------------------------------------------------
def test_parse_sorts_each_rank_counts_rules_and_keys_them_by_integer():
    table = selection.parse({"format": 1, "rules": {"8": [[4096, B], [0, A]], "2": [[0, C]]}})
    assert table == {8: ((0, A), (4096, B)), 2: ((0, C),)}


BAD_PAYLOADS = [
    # (what is wrong, payload, words the message must hold)
    ("not an object", [], "expected a JSON object with a 'rules' object"),
    ("no rules", {"format": 1}, "expected a JSON object with a 'rules' object"),
    ("rules not an object", {"rules": [[0, A]]}, "expected a JSON object with a 'rules' object"),
    ("empty rules", {"rules": {}}, "no rules"),
    ("rank count 1", {"rules": {"1": [[0, A]]}}, "rank count '1' is not an integer >= 2"),
    ("rank count not a number", {"rules": {"two": [[0, A]]}}, "rank count 'two' is not an integer >= 2"),
    ("rank count negative", {"rules": {"-4": [[0, A]]}}, "rank count '-4' is not an integer >= 2"),
    ("no rules for a count", {"rules": {"2": []}}, "rules for 2 ranks must be a non-empty list"),
    ("rules not a list", {"rules": {"2": {"0": A}}}, "rules for 2 ranks must be a non-empty list"),
    ("unknown algorithm", {"rules": {"4": [[0, "butterfly"]]}}, "bad rule [0, 'butterfly'] for 4 ranks"),
    ("negative size", {"rules": {"4": [[0, A], [-1, B]]}}, "bad rule [-1, 'ring'] for 4 ranks"),
    ("fractional size", {"rules": {"4": [[0.5, A]]}}, "bad rule [0.5, 'naive'] for 4 ranks"),
    ("size as text", {"rules": {"4": [["0", A]]}}, "bad rule ['0', 'naive'] for 4 ranks"),
    ("three fields", {"rules": {"4": [[0, A, 1]]}}, "bad rule [0, 'naive', 1] for 4 ranks"),
    ("no rule from 0", {"rules": {"4": [[16, A], [1024, B]]}}, "rules for 4 ranks must start at min_bytes 0"),
    ("online not an object", {"online": []}, "'online' must be an object"),
    ("online layout not an object", {"online": {"2/1": 3}}, "'online' must be an object"),
    ("online entry unknown algorithm", {"online": {"2/1": {"64": {"algorithm": "warp"}}}},
     "bad online entry '64' for '2/1'"),
    ("online entry not a size", {"online": {"2/1": {"big": {"algorithm": A}}}}, "bad online entry 'big' for '2/1'"),
    ("empty online, no rules", {"online": {}}, "no rules"),
    ("online of an unknown collective", {"online": {"gather 2/1": {"64": {"algorithm": A}}}},
     "online layout 'gather 2/1' names no collective"),
    ("online entry not the collective's algorithm", {"online": {"broadcast 2/1": {"64": {"algorithm": "two_shot"}}}},
     "bad online entry '64' for 'broadcast 2/1'"),
]


def test_another_collectives_online_results_are_kept_under_its_name():
    table = selection.parse({"online": {"reduce_scatter 4/1": {"2048": {"algorithm": "pairwise"}},
                                        "4/1": {"2048": {"algorithm": "two_shot"}}}})
    assert table.online["reduce_scatter 4/1"]["2048"]["algorithm"] == "pairwise"


@pytest.mark.parametrize("what, payload, words", BAD_PAYLOADS, ids=[case[0] for case in BAD_PAYLOADS])
def test_parse_names_the_fault_and_the_file(what, payload, words):
    with pytest.raises(ValueError) as raised:
        selection.parse(payload, "tuning file /x/t.json")
    message = str(raised.value)
    assert message.startswith("tuning file /x/t.json: "), message
    assert words in message, message


def test_the_unknown_algorithm_message_lists_the_known_ones():
    with pytest.raises(ValueError, match=re.escape("one of " + ", ".join(ALGORITHMS))):
        selection.parse({"rules": {"2": [[0, "butterfly"]]}})


# -- where the table comes from ----------------------------------------------------------------
def test_without_a_setting_or_a_file_the_builtin_table():
    assert not selection.default_path().exists()
    assert selection.load() == (selection.BUILTIN, "builtin")


def test_the_default_file_beats_the_builtin_table(tmp_path):
    assert selection.default_path() == tmp_path / "config" / "allreduce_kit" / "tuning.json"
    path = write_json(selection.default_path(), {"rules": {"4": [[0, A]]}})
    assert selection.load() == ({4: ((0, A),)}, path)


def test_the_environment_beats_the_default_file(tmp_path, monkeypatch):
    write_json(selection.default_path(), {"rules": {"4": [[0, A]]}})
    chosen = write_json(tmp_path / "chosen.json", {"rules": {"4": [[0, B]]}})
    monkeypatch.setenv(selection.ENV, chosen)
    assert selection.load() == ({4: ((0, B),)}, chosen)
    monkeypatch.setenv(selection.ENV, "builtin")
    assert selection.load() == (selection.BUILTIN, "builtin"), "'builtin' skips the default file too"


def test_a_path_passed_in_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(selection.ENV, write_json(tmp_path / "env.json", {"rules": {"4": [[0, A]]}}))
    given = write_json(tmp_path / "given.json", {"rules": {"4": [[0, C]]}})
    assert selection.load(given) == ({4: ((0, C),)}, given)


def test_an_empty_setting_counts_as_unset(monkeypatch):
    monkeypatch.setenv(selection.ENV, "  ")
    assert selection.load() == (selection.BUILTIN, "builtin")


def test_a_named_file_that_is_missing_raises_naming_it_and_the_variable(tmp_path, monkeypatch):
    missing = tmp_path / "missing.json"
    monkeypatch.setenv(selection.ENV, str(missing))
    with pytest.raises(ValueError, match=re.escape(f"tuning file {missing} (from ${selection.ENV})")):
        selection.load()


def test_a_missing_file_that_online_tuning_is_to_write_starts_from_the_builtin_table(tmp_path, monkeypatch):
    monkeypatch.setenv(selection.ENV, str(tmp_path / "new.json"))
    monkeypatch.setenv(config.ONLINE_TUNING.name, "save")
    assert selection.load() == (selection.BUILTIN, "builtin")
    online.save(str(tmp_path / "new.json"), "2/1", 64, {"algorithm": "shared_memory"})   # then written
    assert selection.load()[0].online == {"2/1": {"64": {"algorithm": "shared_memory"}}}


@pytest.mark.parametrize("where", ["environment", "default file"])
def test_a_malformed_file_raises_wherever_it_was_found(tmp_path, monkeypatch, where):
    """A broken default file is not skipped in favour of the built-in table: the user wrote it."""
    path = tmp_path / "t.json" if where == "environment" else selection.default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if where == "environment":
        monkeypatch.setenv(selection.ENV, str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"tuning file {path}: not JSON")):
        selection.load()
    path.write_text(json.dumps({"rules": {"4": [[8, A]]}}))
    with pytest.raises(ValueError, match=re.escape(f"tuning file {path}: the rules for 4 ranks must start at min_bytes 0")):
        selection.load()


# -- writing a tuning file ---------------------------------------------------------------------
def test_write_adds_rank_counts_and_replaces_only_the_one_measured(tmp_path):
    path = str(tmp_path / "sub" / "tuning.json")
    selection.write(path, 8, [(0, A), (4096, B)], {"at": "first"})
    selection.write(path, 16, [(0, C)], {"at": "second"})
    payload = selection.write(path, 8, [(0, B)], {"at": "third"})     # a new tune at 8 replaces 8 only
    on_disk = json.loads(open(path).read())
    assert on_disk == payload
    assert on_disk["format"] == selection.FORMAT
    assert list(on_disk["rules"]) == ["8", "16"], "ordered by rank count as a number"
    assert on_disk["rules"] == {"8": [[0, B]], "16": [[0, C]]}
    assert on_disk["measured"] == {"8": {"at": "third"}, "16": {"at": "second"}}
    assert selection.load(path) == ({8: ((0, B),), 16: ((0, C),)}, path)


def test_write_orders_rank_counts_numerically(tmp_path):
    path = str(tmp_path / "tuning.json")
    for size in (16, 2, 8):
        selection.write(path, size, [(0, A)], {})
    assert list(json.loads(open(path).read())["rules"]) == ["2", "8", "16"]


def test_write_refuses_to_extend_a_broken_file_and_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"rules": {"4": [[0, "butterfly"]]}}))
    before = path.read_text()
    with pytest.raises(ValueError, match=re.escape(f"tuning file {path}: bad rule")):
        selection.write(str(path), 8, [(0, A)], {})
    assert path.read_text() == before


def test_write_refuses_bad_new_rules_and_writes_nothing(tmp_path):
    path = tmp_path / "tuning.json"
    with pytest.raises(ValueError, match="must start at min_bytes 0"):
        selection.write(str(path), 4, [(64, A)], {})
    assert not path.exists()
    selection.write(str(path), 2, [(0, A)], {})
    before = path.read_text()
    with pytest.raises(ValueError, match="bad rule"):
        selection.write(str(path), 4, [(0, "butterfly")], {})
    assert path.read_text() == before


def test_a_tuning_file_is_used_only_at_the_rank_counts_and_sizes_it_measured(tmp_path):
    """A 2-rank tune over 8-64 B must not decide 16 MiB, nor any size at 3, 4 or 8 ranks."""
    path = tmp_path / "narrow.json"
    selection.write(str(path), 2, [(0, "naive")], {"sizes": [8, 64]})
    table, source = selection.load(str(path))
    assert table.ranges == {2: (8, 64)}
    at2 = selection.auto_from(table, source, 2)
    assert [at2.choose(n) for n in (8, 32, 64)] == ["naive"] * 3
    for nbytes in (4, 65, 16 << 20):
        assert at2.choose(nbytes) == selection.choose(nbytes, 2), nbytes        # the built-in table's
    assert at2.source == f"{path} for 8 B to 64 B; built-in elsewhere"
    for ranks in (3, 4, 8):
        other = selection.auto_from(table, source, ranks)
        assert other.source.startswith("builtin") and str(path) in other.source
        assert [other.choose(n) for n in (8, 16 << 20)] == [selection.choose(n, ranks) for n in (8, 16 << 20)]


def test_measured_sizes_that_make_no_sense_are_refused():
    with pytest.raises(ValueError, match=r"measured sizes for 2 ranks must be \[smallest, largest\]"):
        selection.parse({"rules": {"2": [[0, "ring"]]}, "measured": {"2": {"sizes": [64, 8]}}})


# -- online tuning: its schedule and its file ---------------------------------------------------
@pytest.mark.parametrize("nbytes, low", [(1, 1), (4, 4), (7, 4), (8, 8), (1000, 512), ((1 << 20) + 3, 1 << 20)])
def test_a_size_class_is_a_power_of_two_range(nbytes, low):
    assert online.size_class(nbytes) == low


def test_exploration_is_bounded_and_tries_the_table_choice_first():
    """Each class's exploration is a fixed number of calls: candidates x (timed rounds + 1) x turn."""
    for nbytes in (4, 16 << 10, 60 << 10, 64 << 10, 1 << 20, 64 << 20):
        names, block = online.candidates_for(nbytes, "tree")
        assert names[0] == "tree" and len(set(names)) == len(names) and set(names) <= set(ALGORITHMS)
        assert online.exploration_calls(nbytes, "tree") == len(names) * (online.ROUNDS + 1) * block
        assert online.exploration_calls(nbytes) <= 80
        assert online.exploration_calls(nbytes, "tree", 2) == len(names) * (1 + 3 * online.ROUNDS) * block
    assert online.candidates_for(4, "shared_memory") == (("shared_memory", "recursive_doubling"), 8)
    assert "two_shot" in online.candidates_for(16 << 10, "shared_memory")[0]  # it can win there when lines move slowly
    assert online.candidates_for(64 << 20, "two_shot")[0] == ("two_shot", "shared_memory", "rabenseifner", "ring")


def test_with_direct_transfers_large_classes_skip_what_two_shot_outruns():
    """Where ranks read each other's buffers, ``rabenseifner`` and ``ring`` move the same bytes
    as ``two_shot`` with more memory traffic: from ``DOMINATED_FROM`` they are not explored,
    unless the table chose one; below it, and by messages, they still are."""
    big = online.DOMINATED_FROM
    assert online.candidates_for(big, "shared_memory", direct=True)[0] == ("shared_memory", "two_shot")
    assert online.candidates_for(64 << 20, "ring", direct=True)[0] == ("ring", "shared_memory", "two_shot")
    assert "rabenseifner" in online.candidates_for(big - 1, "shared_memory", direct=True)[0]
    assert online.candidates_for(big, "shared_memory", direct=False)[0] == ("shared_memory", "two_shot",
                                                                             "rabenseifner", "ring")
    assert online.exploration_calls(big, direct=True) < online.exploration_calls(big)


@pytest.mark.parametrize("text, mode", [("1", "on"), ("on", "on"), ("TRUE", "on"), ("0", "off"), ("off", "off"),
                                        ("save", "save"), (" Save ", "save"), ("", "on")])
def test_the_online_setting_parses(monkeypatch, text, mode):
    monkeypatch.setenv(config.ONLINE_TUNING.name, text)
    assert config.read(config.ONLINE_TUNING) == mode


def test_a_bad_online_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(config.ONLINE_TUNING.name, "sometimes")
    with pytest.raises(ValueError, match="ALLREDUCE_KIT_ONLINE_TUNING='sometimes'"):
        config.read(config.ONLINE_TUNING)


def test_save_mode_writes_where_auto_reads(tmp_path, monkeypatch):
    assert online.save_path() == str(selection.default_path())
    monkeypatch.setenv(selection.ENV, str(tmp_path / "t.json"))
    assert online.save_path() == str(tmp_path / "t.json")
    monkeypatch.setenv(selection.ENV, "builtin")
    with pytest.raises(ValueError, match="ALLREDUCE_KIT_ONLINE_TUNING=save needs a tuning file"):
        online.save_path()


ENTRY = {"algorithm": "two_shot", "sizes": [1 << 20, (2 << 20) - 1], "times_us": {"two_shot": 90.0, B: 120.0}}


def test_saving_keeps_the_rules_and_a_later_tune_keeps_what_was_saved(tmp_path):
    path = str(tmp_path / "deep" / "t.json")
    online.save(path, "4/1", 1 << 20, ENTRY)              # a new file: only what online tuning saved
    table = selection.parse(json.load(open(path)))
    assert dict(table) == {} and table.online == {"4/1": {str(1 << 20): ENTRY}}
    selection.write(path, 2, [(0, A)], {"sizes": [4, 64]})
    online.save(path, "4/1", 64, dict(ENTRY, algorithm=C))
    payload = json.load(open(path))
    assert payload["rules"] == {"2": [[0, A]]} and payload["measured"] == {"2": {"sizes": [4, 64]}}
    assert set(payload["online"]["4/1"]) == {str(1 << 20), "64"}
    selection.write(path, 4, [(0, B)], {})
    assert json.load(open(path))["online"] == payload["online"], "a tune dropped what online tuning saved"
    assert not list(tmp_path.glob("deep/*.tmp"))


def test_saving_refuses_to_extend_a_broken_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"rules": {"2": [[0, "butterfly"]]}}')
    with pytest.raises(ValueError, match="butterfly"):
        online.save(str(path), "2/1", 64, ENTRY)
    assert "butterfly" in path.read_text()


def test_a_saved_class_is_settled_where_the_builtin_table_decides_only(tmp_path):
    """The saved entries reach the tuner through the loaded table; where a tuning file's rules
    decide, they do, saved or not."""
    path = write_json(tmp_path / "t.json", {"rules": {"4": [[0, A]]}, "measured": {"4": {"sizes": [4, 1024]}},
                                            "online": {"4/1": {"64": dict(ENTRY, algorithm=C),
                                                               str(1 << 20): ENTRY}}})
    table, source = selection.load(path)
    auto = selection.auto_from(table, source, 4)
    auto.saved = table.online

    class Lib:  # what a tuner reads of a communicator
        nranks, myrank = 4, 0
        layout = type("Layout", (), {"nodes": 1, "single_node": True})()

    tuner = online.Tuner(Lib(), auto, "on", None)
    assert tuner.choice(100) == A and tuner.class_for(100).quiet > 1 << 40, "the file's rule for 64..127 B"
    assert tuner.choice((1 << 20) + 5) == "two_shot" and not tuner.class_for(1 << 20).exploring
    assert tuner.class_for(1 << 20).reference == pytest.approx(90e-6)
    assert tuner.class_for(4096).exploring and tuner.choice(4096) == selection.choose(4096, 4)


def test_across_nodes_the_tuner_times_the_few_round_algorithms_below_the_cost_models_edge_only():
    """Across nodes the cost model's choice is the prior; below ``multinode.tuned_below`` the
    class explores ``multinode.CANDIDATES``, from there the model's choice against MPI's own call
    alone, and a class saved for the layout starts settled."""
    top = Topology.from_parts(0, [0, 0, 1, 1, 2, 2, 3, 3], [2] * 4, ["n1", "n2", "n3", "n4"])

    class Lib:
        nranks, myrank, layout = 8, 0, top

    auto = multinode.NodeAware(top, {"8/4": {"64": dict(ENTRY, algorithm=C, times_us={C: 50.0})}})
    tuner = online.Tuner(Lib(), auto, "on", None)
    edge = multinode.tuned_below(top)
    small = tuner.class_for(edge - 1)
    assert small.exploring and small.candidates == ("mpi", "recursive_doubling", "tree", "hierarchical")
    assert tuner.choice(edge - 1) == "mpi", "the model's choice while the class explores"
    large = tuner.class_for(edge)
    assert large.candidates == ("hierarchical", "mpi") and large.exploring
    assert tuner.class_for(64 << 20).exploration_calls == 10, "one call per turn at 64 MiB: 2 x (1 + 4 rounds)"
    assert tuner.choice(edge) == "hierarchical", "the model's choice while the class explores"
    assert tuner.choice(100) == C and not tuner.class_for(100).exploring, "saved for 8 ranks on 4 nodes"
    assert tuner.class_for(100).reference == pytest.approx(50e-6)
