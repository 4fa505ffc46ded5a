"""Every schedule's messages carry a tag of its own on the library's communicator: no two
algorithm modules, of any collective or wire format, share a ``TAG``, so a message of one can
never be taken for another's."""
import importlib
import pkgutil

import allreduce_kit.algorithms as algorithms
import allreduce_kit.compression as compression


def test_no_two_algorithm_modules_share_a_tag():
    owners = {}
    for package in (algorithms, compression):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            tag = getattr(importlib.import_module(info.name), "TAG", None)
            if isinstance(tag, int):
                owners.setdefault(tag, []).append(info.name)
    assert len(owners) >= 20, f"the schedules' tags were not found: {owners}"
    shared = {tag: names for tag, names in owners.items() if len(names) > 1}
    assert not shared, f"modules share a tag: {shared}"
