"""--vector-env ale: ale-py's C++ vector env with the Python stack's learning episodes, on real ALE games."""

import numpy as np

import ppo_atari_multigpu as ppo


def play(env_id: str, num_envs: int, steps: int, seed: int):
    """Random actions through AtariVectorGames; yields each step's results and the frame numbers before it."""
    envs = ppo.AtariVectorGames(env_id, num_envs, num_threads=1)
    _, info = envs.reset(seed=[seed + i for i in range(num_envs)])
    rng = np.random.default_rng(seed)
    try:
        for _ in range(steps):
            frames_before = info["episode_frame_number"].copy()
            obs, reward, terminated, truncated, info = envs.step(rng.integers(envs.single_action_space.n, size=num_envs))
            yield frames_before, obs, reward, terminated, truncated, info
    finally:
        envs.close()


def test_every_transition_is_real():
    # Each step moves a game on by exactly 4 frames; only when a game ends is the returned observation the
    # next game's first (a few no-op and FIRE frames in). A NEXT_STEP env would insert one step that moves
    # no game at all, with its action ignored.
    games = 0
    for frames_before, obs, _, terminated, truncated, info in play("BreakoutNoFrameskip-v4", 2, 1500, seed=3):
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
        ended = info["final_info"]["_episode"] if "final_info" in info else np.zeros(2, bool)
        for i in range(2):
            if ended[i]:
                games += 1
                assert info["episode_frame_number"][i] <= 30 + 4, info
            else:
                assert info["episode_frame_number"][i] == frames_before[i] + 4
    assert games >= 2


def test_a_lost_life_ends_the_learning_episode_but_not_the_game():
    for frames_before, _, _, terminated, _, info in play("BreakoutNoFrameskip-v4", 1, 1000, seed=1):
        if terminated[0]:
            break
    assert info["lives"][0] == 4 and "final_info" not in info  # a life was lost, the game goes on
    assert info["episode_frame_number"][0] == frames_before[0] + 4  # the same game continued


def test_games_are_reported_whole_and_unclipped():
    # Space Invaders has 3 lives and pays 5 to 30 points per alien: one game spans 3 learning episodes, and
    # its raw return is at least 5 times the sum of the clipped rewards the learner saw.
    clipped, learning_episodes, steps, games = np.zeros(2), np.zeros(2, int), np.zeros(2, int), []
    for _, _, reward, terminated, truncated, info in play("SpaceInvadersNoFrameskip-v4", 2, 6000, seed=4):
        assert set(np.unique(reward)) <= {-1.0, 0.0, 1.0}
        clipped += reward
        steps += 1
        learning_episodes += terminated | truncated
        if "final_info" in info:
            for i in np.flatnonzero(info["final_info"]["_episode"]):
                episode = info["final_info"]["episode"]
                games.append((episode["r"][i], episode["l"][i], clipped[i], learning_episodes[i], steps[i]))
                clipped[i], learning_episodes[i], steps[i] = 0, 0, 0
        if len(games) >= 2:
            break
    assert len(games) >= 2
    for episodic_return, length, clipped_sum, lives, agent_steps in games:
        assert lives == 3
        assert episodic_return >= 5 * clipped_sum > 0
        assert length == 4 * agent_steps


def test_same_seeds_same_games_whatever_the_threads():
    # The C++ threads step envs in any order; each env's game depends on its seed and actions alone.
    runs = []
    for num_threads in (1, 2):
        envs = ppo.AtariVectorGames("BreakoutNoFrameskip-v4", 4, num_threads=num_threads)
        obs, _ = envs.reset(seed=[5, 6, 7, 8])
        trajectory = [obs]
        for action in np.random.default_rng(0).integers(4, size=(200, 4)):
            obs, reward, terminated, truncated, _ = envs.step(action)
            trajectory += [obs, reward, terminated, truncated]
        envs.close()
        runs.append(trajectory)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_frames_are_the_python_stacks():
    # Same emulator, same max over the last two of 4 frames, same grey and INTER_AREA resize: with no-ops and
    # FIRE taken out of both, every 84x84 frame of a game equals the one the Python stack's wrappers make.
    import ale_py
    import gymnasium as gym

    fast = ale_py.AtariVectorEnv("breakout", 1, num_threads=1, frameskip=4, noop_max=0, use_fire_reset=False,
                                 repeat_action_probability=0.0, stack_num=1)
    env = gym.make("BreakoutNoFrameskip-v4", obs_type="grayscale", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.ResizeObservation(gym.wrappers.MaxAndSkipObservation(env, skip=4), (84, 84))
    fast_obs, _ = fast.reset(seed=np.array([3]))
    obs, _ = env.reset(seed=3)
    np.testing.assert_array_equal(fast_obs[0, -1], obs)
    steps = 0
    for action in np.random.default_rng(0).integers(4, size=2000):
        fast_obs, fast_reward, fast_terminated, _, _ = fast.step(np.array([action]))
        obs, reward, terminated, _, _ = env.step(int(action))
        steps += 1
        np.testing.assert_array_equal(fast_obs[0, -1], obs)
        assert (fast_reward[0], fast_terminated[0]) == (reward, terminated)
        if terminated:
            break
    assert terminated and steps > 100 and len(np.unique(obs)) > 2
    env.close()
    fast.close()


def test_games_start_after_fire_then_0_to_28_no_ops():
    # ale-py presses FIRE (one frame) at reset, then plays (a uniform draw from 0..29) - 1 no-ops, at least 0:
    # 0..28 no-ops, 0 twice as likely as each other count, so a FIRE game's first frame is 1..29 into it.
    # Seed 9 plays none, seed 4 plays 28 (over 3,000 seeds, measured: 0 no-ops 229 times, 1 to 28 100-117 each).
    envs = ppo.AtariVectorGames("BreakoutNoFrameskip-v4", 32, num_threads=1)
    _, info = envs.reset(seed=np.arange(32))
    envs.close()
    noops = info["episode_frame_number"] - 1
    assert noops.min() == 0 and noops.max() == 28 and noops[9] == 0 and noops[4] == 28
    assert len(set(noops.tolist())) >= 12  # and the counts vary
