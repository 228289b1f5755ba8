"""Cloud storage through fsspec: runs, checkpoints, TensorBoard logs and ``consolidate`` on a real
S3 endpoint (moto's standalone server on 127.0.0.1, s3fs as the client) and on ``memory://``.

``memory://`` lives in one process: it serves the runs whose replicas run in the calling process
(one device, xla_native / xla_fsdp); xla_spmd and several devices run the replicas in another
process and are tested on S3 only. GCS (``gs://``, gcsfs) is not tested here: no endpoint.
"""

import io
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import conftest
import pytest
import torch
from conftest import Regressor, make_loader, subprocess_timeout

pytestmark = pytest.mark.filterwarnings("ignore:ModelCheckpoint. the dirpath has changed:UserWarning")

pytest.importorskip("s3fs", reason="the test extra installs s3fs and moto[server]")
pytest.importorskip("moto")

import fsspec

from xtrainer import Trainer
from xtrainer import checkpoint as ckpt_io
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.checkpoint import fs


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free port of 127.0.0.1, and the environment s3fs (botocore) and
    TensorBoard's own S3 client read; stopped at the end of the session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL", "S3_ENDPOINT")}
    try:
        deadline = time.monotonic() + subprocess_timeout(60)
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start")
                time.sleep(0.1)
        # AWS_ENDPOINT_URL: s3fs (botocore); S3_ENDPOINT: TensorBoard's S3 writer (boto3)
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=url, S3_ENDPOINT=url)
        fsspec.filesystem("s3").clear_instance_cache()
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh bucket: ``s3://<name>``."""
    name = f"xt-{uuid.uuid4().hex[:12]}"
    s3 = fsspec.filesystem("s3")
    s3.mkdir(name)
    return f"s3://{name}"


@pytest.fixture
def memory():
    """A fresh ``memory://`` folder."""
    root = f"memory://xt-{uuid.uuid4().hex[:12]}"
    yield root
    fs.remove(root)


def fit(root, epochs, ckpt_path=None, strategy="auto", callbacks=None, **kwargs):
    model = Regressor(optimizer="adam", lr=0.01)
    callbacks = callbacks if callbacks is not None else [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)]
    trainer = Trainer(max_epochs=epochs, default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                      strategy=strategy, devices=1, callbacks=callbacks, **kwargs)
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1), ckpt_path=ckpt_path)
    return trainer, model


def found(root):
    """The objects under ``root``, relative to it."""
    filesystem, path = fs.filesystem(root)
    filesystem.invalidate_cache()
    return sorted(p[len(path.rstrip("/")) + 1:] for p in filesystem.find(path))


_STRAIGHT = {}


def straight(tmp_path_factory, strategy="auto", epochs=3):
    """The uninterrupted run, on local disk (once per strategy)."""
    if strategy not in _STRAIGHT:
        _STRAIGHT[strategy] = fit(str(tmp_path_factory.mktemp(f"straight-{strategy}")), epochs, strategy=strategy,
                                  logger=False)[1].state_dict()
    return _STRAIGHT[strategy]


def assert_same(state, expected):
    for name, tensor in expected.items():
        assert torch.equal(state[name].cpu(), tensor.cpu()), name


def test_a_run_on_s3_writes_checkpoints_logs_and_config_there_and_resumes_bitwise(bucket, tmp_path_factory):
    root = f"{bucket}/run"
    first, _ = fit(root, 2)
    assert first.log_dir == f"{root}/version_0"
    assert not fs.claim(f"{root}/version_0/.xtrainer-claim", "another run")  # S3's conditional put: taken
    objects = found(root)
    assert {"version_0/hparams.yaml", "version_0/checkpoints/last.ckpt", "version_0/checkpoints/epoch=1-step=16.ckpt",
            "version_0/checkpoints/epoch=0-step=4.ckpt"} <= set(objects)
    assert [o for o in objects if o.startswith("version_0/events.out.tfevents.")]  # TensorBoard's events
    assert ckpt_io.verify(f"{root}/version_0/checkpoints/last.ckpt").global_step == 16
    from xtrainer import config as cfg_io

    path = cfg_io.save_config({"trainer": {"max_epochs": 3}}, first.log_dir)
    assert path == f"{root}/version_0/config.yaml" and "max_epochs: 3" in fs.read_bytes(path).decode()

    resumed, model = fit(root, 3, ckpt_path="last")
    assert resumed.ckpt_path == f"{root}/version_0/checkpoints/last.ckpt" and resumed.global_step == 24
    assert resumed.log_dir == f"{root}/version_1"  # a new version, claimed on the object store
    assert_same(model.state_dict(), straight(tmp_path_factory))


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_half_written_checkpoint_is_skipped_by_last(where, request, tmp_path_factory):
    """A save killed mid-upload leaves its data objects without the manifest (written last); a
    whole file cut short (a backend without atomic objects) fails its zip check. ``last`` skips
    both and resumes from the newest complete checkpoint."""
    root = request.getfixturevalue("memory" if where == "memory" else "bucket") + "/run"
    fit(root, 1, strategy="xla_fsdp", logger=False)
    folder = f"{root}/version_0/checkpoints"
    filesystem, _ = fs.filesystem(root)
    # the kill: a newer folder with its shards but no manifest, and last.ckpt's copy cut short too
    for name in ("trainer.pt", "rank-00000-of-00001.pt"):
        filesystem.copy(fs.filesystem(f"{folder}/epoch=0-step=8.ckpt/{name}")[1],
                        fs.filesystem(f"{folder}/epoch=1-step=12.ckpt/{name}")[1])
    fs.remove(f"{folder}/last.ckpt/manifest.json")
    # (a folder without a manifest has no date of completion: it is tried last, after every complete one)
    with pytest.warns(UserWarning, match=r"(?s)resuming from .*epoch=0-step=8\.ckpt.*skipped.*last\.ckpt.*no "
                                         r"manifest\.json"):
        resumed, model = fit(root, 3, ckpt_path="last", strategy="xla_fsdp", logger=False)
    assert resumed.ckpt_path == f"{folder}/epoch=0-step=8.ckpt" and resumed.global_step == 24
    assert_same(model.state_dict(), straight(tmp_path_factory, "xla_fsdp"))


def test_a_whole_file_cut_short_on_an_object_store_is_skipped(memory):
    fit(memory, 1, logger=False)
    folder = f"{memory}/version_0/checkpoints"
    data = fs.read_bytes(f"{folder}/last.ckpt")
    with fs.open(f"{folder}/last.ckpt", "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.warns(UserWarning, match=r"(?s)resuming from .*epoch=0-step=8\.ckpt.*last\.ckpt.*truncated"):
        resumed, _ = fit(memory, 2, ckpt_path="last", logger=False)
    assert resumed.global_step == 16


@pytest.mark.slow
def test_spmd_checkpoints_go_through_torch_distributed_checkpoint_on_s3(bucket):
    """Written with torch.distributed.checkpoint's fsspec writer, read back (verified, metadata
    through the restricted unpickler) with its fsspec reader. (The replicas run in another
    process: S3 only. Resuming reads through the same reader; one fit keeps the file short.)"""
    root = f"{bucket}/spmd"
    _, model = fit(root, 1, strategy="xla_spmd", logger=False)
    last = f"{root}/version_0/checkpoints/last.ckpt"
    assert {"manifest.json", "trainer.pt", "state/.metadata"} <= set(found(last))
    assert ckpt_io.verify(last).global_step == 8
    assert_same(ckpt_io.consolidate(last), model.state_dict())


def test_consolidate_reads_from_s3_and_writes_to_s3(bucket):
    from xtrainer.launch import cli

    root = f"{bucket}/fsdp"
    _, model = fit(root, 1, strategy="xla_fsdp", logger=False)
    source, output = f"{root}/version_0/checkpoints/last.ckpt", f"{bucket}/out/full.pt"
    assert cli.main(["consolidate", source, "-o", output]) == 0
    state = torch.load(io.BytesIO(fs.read_bytes(output)), weights_only=True)
    assert_same(state, model.state_dict())
    assert cli.main(["consolidate", source, "-o", f"{source}/inside.pt"]) == 1  # never into what it reads


def test_the_run_folder_claim_on_an_object_store_is_exclusive(memory):
    from xtrainer.loggers import claim_version_dir

    claimed = [claim_version_dir(memory) for _ in range(3)]
    assert claimed == [f"{memory}/version_{i}" for i in range(3)]
    assert not fs.claim(f"{memory}/version_1/.xtrainer-claim", "another run")  # taken: exclusive create


def test_a_missing_client_names_the_extra_to_install(tmp_path):
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed: no protocol here lacks its client")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"pip install 'xtrainer\[gcs\]'"):
        fit("gcs://bucket/run", 1, logger=False)
    with pytest.raises(ckpt_io.CheckpointError, match=r"xtrainer\[gcs\]"):
        fit(str(tmp_path), 1, ckpt_path="gs://bucket/run/last.ckpt", logger=False)


def test_the_command_line_runs_into_an_object_store(memory, tmp_path, monkeypatch):
    from xtrainer.launch import cli

    monkeypatch.chdir(os.path.dirname(os.path.abspath(conftest.__file__)))  # the config's targets live in conftest
    config = tmp_path / "run.yaml"
    config.write_text("model: {_target_: conftest.Regressor}\ndata: {_target_: conftest.RegressionData}\n"
                      "trainer: {max_epochs: 1, enable_progress_bar: false}\n")
    with pytest.warns(UserWarning, match="found no checkpoint"):  # the first start of a restart loop
        assert cli.main(["fit", "--config", str(config), f"trainer.default_root_dir={memory}", "ckpt_path=last"]) == 0
    objects = found(memory)
    assert {"version_0/config.yaml", "version_0/checkpoints/last.ckpt", "version_0/hparams.yaml"} <= set(objects)
    assert cli.main(["fit", "--config", f"{tmp_path}/run.yaml", f"trainer.default_root_dir={memory}",
                     "trainer.max_epochs=2", "ckpt_path=last"]) == 0
    assert ckpt_io.verify(f"{memory}/version_1/checkpoints/last.ckpt").global_step == 16


def test_a_bucket_that_does_not_exist_is_one_clear_error(s3_endpoint, tmp_path):
    with pytest.raises(OSError, match=r"Cannot create the run folder 's3://xt-no-such-bucket/run/version_0'"):
        fit("s3://xt-no-such-bucket/run", 1, logger=False)
    saver = ModelCheckpoint(dirpath="s3://xt-no-such-bucket/ckpts")
    with pytest.raises(ckpt_io.CheckpointError, match=r"Could not write 's3://xt-no-such-bucket/ckpts/.*\.ckpt'"):
        fit(str(tmp_path), 1, callbacks=[saver], logger=False)


@pytest.mark.parametrize("size", [1 << 10, 12 << 20], ids=["one-shot", "multipart"])
def test_a_failed_upload_leaves_the_previous_object(bucket, size):
    from xtrainer.checkpoint import storage

    path = f"{bucket}/ckpts/last.ckpt"
    storage.write_bytes(b"the previous checkpoint", path)

    def dies_half_way(writer):
        writer.write(b"\0" * size)
        raise OSError("the connection dropped")

    with pytest.raises(ckpt_io.CheckpointError, match=r"Could not write .*last\.ckpt.*connection dropped"):
        storage.write_with(dies_half_way, path)
    assert fs.read_bytes(path) == b"the previous checkpoint"


def test_the_csv_logger_refuses_an_object_store(memory):
    from xtrainer.loggers import CSVLogger

    with pytest.raises(ValueError, match="CSVLogger writes local files only"):
        CSVLogger(save_dir=memory).log_metrics({"loss": 1.0}, step=0)
