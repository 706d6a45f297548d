"""The host tier's paced gradient copies: how much they may hold on the device. Runs without a
GPU (the rule reads only the plan); the copies themselves are tested on the GPU
(tests/cpp/host_tier_test.cc HostTierPipeline.Paced*, and test_host_tier.py with pacing on)."""
def test_paced_copies_hold_no_more_than_a_named_budget_allows():
    """How much gradient pacing may keep waiting on the device."""
    from emsa._engine.cuda import _pacing_hold

    class Plan:
        def __init__(self, named, resolved, peak):
            self.json = {"options": {"budget_bytes": named, "bucket_bytes": 32 << 20},
                         "budget_bytes": resolved,
                         "prediction": {"peak_device_bytes": peak}}

    two_buckets = 64 << 20
    # A named budget: only the two buckets in flight the plan already counts, whatever is left.
    assert _pacing_hold(Plan(20 << 30, 20 << 30, 12 << 30)) == two_buckets
    # No budget named: the device's room beyond the plan's peak, plus those two buckets.
    assert _pacing_hold(Plan(0, 100 << 30, 40 << 30)) == (60 << 30) + two_buckets
    # A plan already over what the device has: nothing beyond the two buckets.
    assert _pacing_hold(Plan(0, 10 << 30, 12 << 30)) == two_buckets
