import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.utils import timezone

from benchmarks.models import BenchmarkPoint, BenchmarkRun, Study, StudyTrial, StudyVariant
from deployments.models import Deployment, DeploymentEvent, Gpu, ModelCopy, ModelRepo, Node

PASSWORD = "pw-for-tests-1"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", PASSWORD)

    @factory.post_generation
    def role(self, create, extracted, **kwargs):
        if extracted:
            self.groups.add(Group.objects.get_or_create(name=extracted)[0])
        self.save()


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node

    name = factory.Sequence(lambda n: f"node-{n}")
    address = "127.0.0.1"
    last_heartbeat = factory.LazyFunction(timezone.now)
    # Online for the whole test: a node counts as online for three heartbeats after its last one, and on a busy host a
    # test that made its node, then deployed or edited on it, passed 3 x 5 s and was refused as offline (seen in a
    # whole-suite run beside another). A test about going offline gives its node an agent's 5 s beat itself.
    heartbeat_seconds = 600.0
    model_store = "/models"
    disk_total = 2 * 10**12
    disk_free = 10**12


class GpuFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Gpu

    node = factory.SubFactory(NodeFactory)
    index = factory.Sequence(lambda n: n % 8)
    uuid = factory.Sequence(lambda n: f"GPU-{n:08d}")
    name = "NVIDIA H200"
    memory_total = 141 * 10**9
    compute_capability = "9.0"


class ModelRepoFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelRepo

    repo_id = factory.Sequence(lambda n: f"org/model-{n}")
    architecture = "LlamaForCausalLM"
    total_size = 16 * 10**9


class ModelCopyFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelCopy

    model = factory.SubFactory(ModelRepoFactory)
    node = factory.SubFactory(NodeFactory)
    state = ModelCopy.State.READY


class DeploymentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Deployment

    name = factory.Sequence(lambda n: f"deploy-{n}")
    model = factory.SubFactory(ModelRepoFactory)
    node = factory.SubFactory(NodeFactory)
    port = factory.Sequence(lambda n: 8100 + n)
    engine_args = factory.LazyFunction(lambda: {"tensor-parallel-size": 1})


class DeploymentEventFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = DeploymentEvent

    deployment = factory.SubFactory(DeploymentFactory)
    step = "launch"
    message = "vllm serve started"


class BenchmarkRunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = BenchmarkRun

    deployment = factory.SubFactory(DeploymentFactory)
    params = factory.LazyFunction(lambda: {"concurrency": [1, 2, 4]})


class BenchmarkPointFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = BenchmarkPoint

    run = factory.SubFactory(BenchmarkRunFactory)
    concurrency = factory.Sequence(lambda n: 2 ** (n % 20))  # distinct within a run; within int4 however many are made
    output_throughput = 1000.0
    ttft_ms = factory.LazyFunction(lambda: {"median": 50.0})


class StudyFactory(factory.django.DjangoModelFactory):
    """A queued study of a deployment with its baseline and one variant, one repeat each."""

    class Meta:
        model = Study
        skip_postgeneration_save = True

    deployment = factory.SubFactory(DeploymentFactory)
    workload = factory.LazyFunction(lambda: {"levels": [1]})
    repeats = 1

    @factory.post_generation
    def variants(self, create, extracted, **kwargs):
        if create:
            base = StudyVariant.objects.create(study=self, position=0, name="baseline", is_baseline=True)
            other = StudyVariant.objects.create(study=self, position=1, name="seqs 8", engine_args={"max-num-seqs": 8})
            StudyTrial.objects.create(study=self, variant=base, position=0, repeat=1)
            StudyTrial.objects.create(study=self, variant=other, position=1, repeat=1)
