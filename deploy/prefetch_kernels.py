"""Pre-fetch Hub kernels into the image at build time, so workers need no Hub access for them at run time.

    KERNELS_CACHE=/opt/xpu-jobs/kernels python prefetch_kernels.py --backend xpu \
        "kernels-community/flash-attn2 kernels-community/rmsnorm kernels-community/activation"

Each name is a Hub kernel repository, optionally with an explicit major version (`repo:2`). Without one, the
versions are those the installed transformers asks for on this backend (its flash-attention fallback table and
its `use_kernels` layer mapping), so the image always holds what its own transformers will load.

For every kernel the script
  1. downloads the build variant that matches the installed torch (`kernels.install_kernel`),
  2. records the version branch (`refs/v<N>`) in the cache: an online download resolves the version to a commit
     and does not write that ref, and the kernels library needs it to resolve `version=N` offline,
  3. resolves the kernel again from the cache alone, as a worker with HF_HUB_OFFLINE=1 would.
Any failure fails the build: an image that says it carries kernels must carry them.
"""

import argparse
import inspect
import os
import sys


def wanted_versions(backend: str) -> dict[str, set[int]]:
    """repo id -> major versions the installed transformers loads on `backend`."""
    found: dict[str, set[int]] = {}

    def add(repo_id, version):
        if repo_id and isinstance(version, int):
            found.setdefault(repo_id, set()).add(version)

    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_DEVICES, FLASH_ATTN_KERNEL_VERSIONS
    except ImportError:
        FLASH_ATTN_KERNEL_DEVICES, FLASH_ATTN_KERNEL_VERSIONS = {}, {}
    for repo_id, version in FLASH_ATTN_KERNEL_VERSIONS.items():
        if backend in FLASH_ATTN_KERNEL_DEVICES.get(repo_id, (backend,)):
            add(repo_id, version)

    try:
        from transformers.integrations import hub_kernels
        mapping = hub_kernels.get_kernel_mapping_transformers()
    except (ImportError, AttributeError):
        mapping = {}
    for per_device in mapping.values():
        for device, spec in per_device.items():
            if str(getattr(device, "type", device)) != backend:
                continue
            for repo in (spec.values() if isinstance(spec, dict) else [spec]):
                add(getattr(repo, "_repo_id", getattr(repo, "repo_id", None)), getattr(repo, "_version", None))
    return found


def parse_requests(names: list[str], backend: str) -> list[tuple[str, int]]:
    known = None
    requests = []
    for name in names:
        repo_id, _, version = name.partition(":")
        if version:
            requests.append((repo_id, int(version)))
            continue
        if known is None:
            known = wanted_versions(backend)
        if repo_id not in known:
            raise SystemExit(f"prefetch_kernels: the installed transformers loads no {repo_id!r} on {backend}; "
                             f"name a version explicitly ({repo_id}:N) or drop it. Known here: {sorted(known)}")
        requests.extend((repo_id, v) for v in sorted(known[repo_id]))
    return requests


def _call(fn, **kwargs):
    """Pass only the keyword arguments this version of the kernels library accepts."""
    accepted = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def prefetch(repo_id: str, version: int, backend: str, cache_dir: str) -> str:
    import kernels
    from huggingface_hub import HfApi

    variant_path = _call(kernels.install_kernel, repo_id=repo_id, version=version, backend=backend)
    # Download again by branch name: the files are already there, and huggingface_hub now writes refs/v<N>.
    HfApi().snapshot_download(repo_id, repo_type="kernel", revision=f"v{version}", cache_dir=cache_dir,
                              allow_patterns=[f"build/{variant_path.name}/*"])
    offline = _call(kernels.install_kernel, repo_id=repo_id, version=version, backend=backend,
                    local_files_only=True)
    return str(offline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="xpu", help="the backend the image's torch was built for")
    parser.add_argument("kernels", nargs="*", help="repo ids (or repo:N); a single space-separated string works too")
    parser.add_argument("--list", action="store_true", help="print what transformers loads on the backend and exit")
    args = parser.parse_args(argv)

    if args.list:
        for repo_id, versions in sorted(wanted_versions(args.backend).items()):
            print(repo_id, " ".join(f"v{v}" for v in sorted(versions)))
        return 0
    cache_dir = os.environ.get("KERNELS_CACHE")
    if not cache_dir:
        raise SystemExit("prefetch_kernels: set KERNELS_CACHE to the directory the workers will read kernels from")
    names = [n for arg in args.kernels for n in arg.split()]
    if not names:
        print("prefetch_kernels: nothing to fetch")
        return 0
    for repo_id, version in parse_requests(names, args.backend):
        path = prefetch(repo_id, version, args.backend, cache_dir)
        print(f"prefetch_kernels: {repo_id} v{version} -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
