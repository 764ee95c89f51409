"""`spec.model.instances` as the real API server validates it (the CRD's CEL rule) and the operator passes
it to the runtime's config."""

from __future__ import annotations

import yaml

from carpool.operator.resources.labels import CONFIG_FILE
from tests.cluster.api import Api
from tests.cluster.conftest import Operator
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children


def test_instances_reach_the_runtime_config_and_more_than_one_for_generate_is_refused(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    chat = batched_model("chat", namespace, model={"task": "generate", "instances": 2})
    done = kubectl_apply(admin_env, chat, check=False)
    assert done.returncode != 0, "the API server accepted two instances for task generate"
    assert "instances above 1 apply to embed, classify and rerank" in done.stderr, done.stderr
    assert api.get("BatchedModel", namespace, "chat") is None

    kubectl_apply(admin_env, batched_model("embedder", namespace, model={"instances": 3}))
    children = wait_for_children(api, namespace, "embedder", kinds=("ConfigMap",))
    config = yaml.safe_load(children["ConfigMap"]["data"][CONFIG_FILE])
    assert config["model"]["instances"] == 3
