"""Errors of the graph stage, across node ids: invalid ids, ``needs`` naming a
missing, disabled or the same node, dependency cycles, every node disabled;
then roles, ``load_order`` and ``save_to``.

Test plugin types (``cache``, ``tracker``, ``blend``) and the ``problems``
checker come from conftest.
"""

from __future__ import annotations

from pipeline_checks import Check

# --------------------------------------------------------------------------- #
# node ids and dependencies
# --------------------------------------------------------------------------- #


def test_invalid_node_id(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n  1st cache: {plugin: tracker}\n") == [
        'p.yaml:3:3: nodes["1st cache"]: node ids start with a letter and use letters, digits, '
        "'-' and '_' only"
    ]


def test_needs_naming_a_missing_node_suggests_the_close_one(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          tracker: {plugin: tracker}
          blend:
            plugin: blend
            needs: [tracker, trackr]
        """
    ) == [
        'p.yaml:6:22: nodes.blend.needs[1]: node "trackr" does not exist '
        '(did you mean "tracker"?); nodes: "blend", "tracker"'
    ]


def test_self_dependency_is_one_problem_not_also_a_cycle(problems: Check) -> None:
    text = "version: 1\nnodes:\n  a: {plugin: cache, needs: [a], config: {capacity: 1}}\n"
    assert problems(text) == ["p.yaml:3:30: nodes.a.needs[0]: a node cannot need itself"]


def test_cycle_is_printed_as_its_full_path(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: tracker, needs: [b]}
          b: {plugin: tracker, needs: [c]}
          c: {plugin: tracker, needs: [a]}
          d: {plugin: tracker, needs: [a]}
        """
    ) == ["p.yaml:3:32: nodes.a.needs[0]: dependency cycle: a -> b -> c -> a"]


def test_a_pipeline_with_every_node_disabled(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          a: {plugin: tracker, enabled: false}
          b: {plugin: cache, enabled: false, config: {capacity: 1GiB}}
        """
    ) == ["p.yaml:3:3: nodes: every node is disabled; enable at least one"]


def test_needing_a_disabled_node(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          t: {plugin: tracker, enabled: false}
          b: {plugin: blend, needs: [t]}
        """
    ) == [
        # The tracker is off, so the blend node is left without a model too.
        "p.yaml:4:29: nodes.b.needs: needs the model but no dependency provides it "
        "(add a model-tracker node)",
        'p.yaml:4:30: nodes.b.needs[0]: node "t" is disabled',
    ]


# --------------------------------------------------------------------------- #
# load order, save targets and roles
# --------------------------------------------------------------------------- #


def test_load_order_and_save_to_problems(problems: Check) -> None:
    assert problems(
        """\
        version: 1
        nodes:
          t: {plugin: tracker}
          c: {plugin: cache, config: {capacity: 1GiB}}
        load_order: [c, cc, c, t]
        save_to: [t, c, c]
        """
    ) == [
        'p.yaml:5:17: load_order[1]: node "cc" does not exist (did you mean "c"?); nodes: "c", "t"',
        'p.yaml:5:21: load_order[2]: node "c" is listed twice',
        'p.yaml:5:24: load_order[3]: node "t" has role "service", which does not load; '
        'roles that load: "both", "load", "transport"',
        'p.yaml:6:11: save_to[0]: node "t" has role "service", which does not save; '
        'roles that save: "both", "save", "transport"',
        'p.yaml:6:17: save_to[2]: node "c" is listed twice',
    ]


def test_role_the_plugin_cannot_take(problems: Check) -> None:
    assert problems("version: 1\nnodes:\n  t: {plugin: tracker, role: load}\n") == [
        'p.yaml:3:30: nodes.t.role: plugin "tracker" cannot take role "load"; '
        'expected one of "service"'
    ]
