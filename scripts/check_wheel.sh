#!/usr/bin/env bash
# Builds the wheel (`pip wheel .`), checks its tag, installs it into a fresh virtual
# environment with no Bazel, jax at each version asked for, and runs the kernel tests there
# against the installed package (a copy of tests/ outside the source tree).
#
#   scripts/check_wheel.sh [JAX_VERSION ...]    (default: the floor pyproject.toml declares,
#                                                0.10.0, and the newest the registry serves)
#   PYTHONS="python3.12 python3.13" scripts/check_wheel.sh ...   the interpreters to install
#                                                it for (default: python3): one wheel, all CPythons
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.10.0 "$(python3 -m pip index versions jax 2>/dev/null | sed -n 's/^jax (\(.*\))$/\1/p')")

python3 -m pip wheel -v --no-deps -w "$WORK/dist" . > "$WORK/wheel.log" 2>&1 || { tail -40 "$WORK/wheel.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/moe_xla-*.whl)
echo "wheel: $(basename "$WHEEL")"
case "$(basename "$WHEEL")" in
  *-py3-none-manylinux_*_$(uname -m).whl) ;;
  *) echo "expected a py3-none-manylinux_*_$(uname -m) wheel"; exit 1 ;;
esac
# The Bazel run inside pip's isolated build environment reused the kernels scripts/build.sh
# compiled (same action keys): no nvcc action ran.
if grep -q "nvcc cutlass" "$WORK/wheel.log"; then
  echo "pip wheel recompiled CUDA kernels:"; grep "nvcc" "$WORK/wheel.log" | tail -5; exit 1
fi

cp -r tests "$WORK/tests"
TESTS=(test_gmm.py test_gmm_autodiff.py test_gmm_errors.py test_gather_gmm.py test_gather_gmm_activate.py test_fused_forward.py test_gather_tgmm.py test_routing.py test_moe.py test_layer_values.py
       test_fp8_quantize.py test_gmm_fp8.py test_fp8_wgrad.py test_moe_fp8.py test_nnx.py
       test_activate_quantize_fp8.py test_activate_grad_quantize_fp8.py test_expand_quantize_fp8_rows.py test_expand_unit_factor.py test_gather_rows.py test_product_combine.py test_activate_weighted_grad.py test_after.py test_gmm_unpermute.py
       test_ep_plan.py test_route_grad.py test_ep_inverses.py)
for python in ${PYTHONS:-python3}; do
for version in "${VERSIONS[@]}"; do
  echo "=== $python ($("$python" --version 2>&1)), jax $version"
  run="$WORK/$(basename "$python")-jax$version"
  "$python" -m venv "$run"
  PY="$run/bin/python"
  "$PY" -m pip install -q "$WHEEL[test,flax]" "jax==$version" "jaxlib==$version" ml_dtypes > "$run.pip.log" 2>&1 \
    || { tail -20 "$run.pip.log"; exit 1; }
  (cd "$WORK/tests" && "$PY" -c "import moe_xla, jax; print('moe_xla from', moe_xla.__file__, '| jax', jax.__version__)" \
    && "$PY" -m pytest -q -p no:cacheprovider --rootdir "$WORK/tests" "${TESTS[@]}" > "$run.pytest.log" 2>&1) \
    || { tail -30 "$run.pytest.log"; exit 1; }
  tail -1 "$run.pytest.log"
done
done
