"""POI values outside the POI's bounds are refused with a 422 that says which and why.

pyhf refuses them too (its fits raise "fit initialization parameter ... lies outside of its
bounds"); before, the server answered numbers (test_poi 20 with bounds [0, 10]: CLs 8.3e-6;
-1 and 1e308: CLs 1.0 with converged false; an upper-limit scan to 100: a limit of 94.75).
A real server over HTTP.
"""

from __future__ import annotations

import pytest
from service_support import ServerProcess, patchset_of, simple_workspace

pytestmark = pytest.mark.timeout(300)


def _with_poi_bounds(lo: float, hi: float) -> dict:
    spec = simple_workspace()
    spec["measurements"][0]["config"]["parameters"] = [{"name": "mu", "bounds": [[lo, hi]]}]
    return spec


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"test_poi": 20.0}, "test_poi value 20.0 lies outside the bounds [0.0, 10.0]"),
        ({"test_poi": 1e308}, "test_poi value 1e+308"),
        ({"test_poi": [1.0, 2.0, 11.0]}, "test_poi value 11.0"),
        ({"test_poi": -1.0, "test_stat": "q"}, "test_poi value -1.0 lies outside"),
        (
            {"test_poi": -1.0, "workspace": _with_poi_bounds(-5.0, 10.0)},
            "test_poi value -1.0 lies outside the bounds [0.0, 10.0] of the POI 'mu' (q~, "
            "test_stat 'qtilde', bounds the POI below at 0)",
        ),
    ],
)
def test_cls_outside_the_poi_bounds_is_a_422(client: ServerProcess, options, needle):
    response = client.post("/cls", json={"workspace": simple_workspace(), **options})
    assert response.status_code == 422, response.text
    assert needle in response.json()["detail"]
    assert "'mu'" in response.json()["detail"]


def test_negative_poi_inside_widened_bounds_is_answered(client):
    body = {"workspace": _with_poi_bounds(-5.0, 10.0), "test_poi": -1.0, "test_stat": "q"}
    response = client.post("/cls", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["meta"]["converged"] is True


def test_upper_limit_scan_outside_the_bounds_is_a_422(client):
    body = {"workspace": simple_workspace(), "scan": [0.0, 5.0, 100.0]}
    response = client.post("/upper-limit", json=body)
    assert response.status_code == 422, response.text
    assert "scan value 100.0 lies outside the bounds [0.0, 10.0]" in response.json()["detail"]
    widened = {"workspace": _with_poi_bounds(-5.0, 100.0), "scan": [-5.0, 50.0, 100.0]}
    response = client.post("/upper-limit", json=widened)
    assert response.status_code == 422  # the upper limit's q~ floors the POI at 0
    assert "scan value -5.0" in response.json()["detail"]


def test_a_patch_whose_poi_bounds_exclude_test_poi_answers_its_own_error(client):
    narrowing = [
        {
            "op": "replace",
            "path": "/measurements/0/config/parameters",
            "value": [{"name": "mu", "bounds": [[0.0, 1.5]]}],
        }
    ]
    patchset = patchset_of(simple_workspace(), [("wide", []), ("narrow", narrowing)])
    body = {"workspace": simple_workspace(), "patchset": patchset, "test_poi": 2.0}
    response = client.post("/cls", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "CLs_obs" in answer["wide"]
    assert answer["narrow"]["error"]["status"] == 422
    assert "outside the bounds [0.0, 1.5]" in answer["narrow"]["error"]["detail"]
    # with a list of POI values: a list of results, but ONE error entry for the broken patch
    response = client.post("/cls", json={**body, "test_poi": [1.0, 2.0]})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [r["meta"]["test_poi"] for r in answer["wide"]] == [1.0, 2.0]
    assert answer["narrow"]["error"]["status"] == 422
