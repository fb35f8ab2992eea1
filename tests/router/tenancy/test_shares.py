"""While the mesh's queues are full, a key's tenant over its share (by weight) of the requests
in progress gets 429 (services/router/tenancy/admission.py): one sending ten times more gets
its share, not the mesh's; the priority class is bounded by its keys' ceilings instead."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from services.router.dispatch.workers import LoopLag
from services.router.errors import ApiError
from services.router.settings import TenancySettings
from services.router.tenancy.admission import Tenancy
from services.router.tenancy.keys import Caller
from shared.security.keys import new_key


def caller(tenant: str, weight: int = 0) -> Caller:
    return Caller(tenant, new_key(tenant, weight=weight)[1])


def test_a_tenant_over_its_share_of_a_full_mesh_is_refused(tmp_path: Path) -> None:
    tenancy = Tenancy(TenancySettings(), tmp_path, LoopLag())
    heavy, light, double = caller("heavy"), caller("light"), caller("double", weight=2)
    with contextlib.ExitStack() as held:
        for _ in range(7):
            held.enter_context(tenancy.admitted(heavy))
        held.enter_context(tenancy.admitted(light))
        tenancy.check_share(light, "default")  # 1 of 8: under its half
        with pytest.raises(ApiError) as err:
            tenancy.check_share(heavy, "default")  # 7 of 8: over its half
        assert err.value.status == 429 and "(7 of 8, its share 4)" in err.value.message
        tenancy.check_share(heavy, "priority")  # (shares bound the other classes)
        for _ in range(5):
            held.enter_context(tenancy.admitted(double))
        tenancy.check_share(double, "default")  # 5 of 13, weight 2 of 4: its share 6.5
        with pytest.raises(ApiError):
            tenancy.check_share(heavy, "flex")  # 7 of 13, weight 1 of 4
    assert tenancy.inflight == 0 and tenancy.by_tenant == {} and tenancy.weights == {}
    tenancy.check_share(heavy, "default")  # alone: nothing to share
