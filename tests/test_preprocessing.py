"""The DeepMind Atari stack on gymnasium 1.x, with real ALE games."""

import gymnasium as gym
import numpy as np

import ppo_atari_multigpu as ppo


def test_observations_are_uint8_frame_stacks():
    env = ppo.make_env("BreakoutNoFrameskip-v4")()
    obs, _ = env.reset(seed=0)
    assert env.observation_space.shape == obs.shape == (4, 84, 84)
    assert obs.dtype == np.uint8
    obs, *_ = env.step(env.action_space.sample())
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8 and obs.max() > 0
    env.close()


def test_fire_is_pressed_after_reset_and_after_every_lost_life():
    # In Breakout the ball is only served on FIRE: a player that only ever sends NOOP never loses a life
    # unless the wrapper presses FIRE after the reset and after each life loss.
    raw = gym.make("BreakoutNoFrameskip-v4")
    raw.reset(seed=0)
    for _ in range(2000):
        raw.step(0)
    assert raw.unwrapped.ale.lives() == 5

    env = ppo.make_env("BreakoutNoFrameskip-v4")()
    env.reset(seed=0)
    lives_lost = 0
    for _ in range(2000):
        _, _, terminated, truncated, info = env.step(0)
        if terminated:
            lives_lost += 1
            if "episode" in info:  # game over
                break
            env.reset()
    assert lives_lost == 5
    env.close()


def test_life_loss_ends_learning_episode_but_not_the_game():
    env = ppo.make_env("BreakoutNoFrameskip-v4")()
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    while True:
        _, _, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            break
    ale = env.unwrapped.ale
    assert ale.lives() == 4 and "episode" not in info  # a life was lost, the game goes on
    frame_before = ale.getEpisodeFrameNumber()
    env.reset()
    assert ale.lives() == 4
    assert ale.getEpisodeFrameNumber() > frame_before  # the emulator continued instead of restarting
    env.close()


def test_episode_statistics_are_whole_game_and_unclipped():
    # Space Invaders scores 5 to 30 points per alien, so clipped and raw returns differ.
    envs = ppo.make_vector_env("SpaceInvadersNoFrameskip-v4", 2)
    envs.reset(seed=[3, 4])
    rng = np.random.default_rng(0)
    clipped_sum = np.zeros(2)
    life_episodes = np.zeros(2, dtype=int)
    agent_steps = np.zeros(2, dtype=int)
    games = []
    for _ in range(5000):
        _, reward, terminated, truncated, infos = envs.step(rng.integers(envs.single_action_space.n, size=2))
        assert set(np.unique(reward)) <= {-1.0, 0.0, 1.0}  # the learner sees clipped rewards
        clipped_sum += reward
        agent_steps += 1
        life_episodes += terminated | truncated
        if "final_info" in infos and "episode" in infos["final_info"]:
            for i in np.flatnonzero(infos["final_info"]["_episode"]):
                games.append((infos["final_info"]["episode"]["r"][i], infos["final_info"]["episode"]["l"][i],
                              clipped_sum[i], life_episodes[i], agent_steps[i]))
                clipped_sum[i], life_episodes[i], agent_steps[i] = 0, 0, 0
        if len(games) >= 2:
            break
    envs.close()
    assert len(games) >= 2
    for episodic_return, length, clipped, lives, steps in games:
        assert lives == 3  # Space Invaders has 3 lives: one reported game spans 3 learning episodes
        assert episodic_return >= 5 * clipped > 0  # raw points, not the clipped +1 per alien
        assert length >= 4 * steps  # length in emulator frames over the whole game


def test_vector_env_stores_only_real_transitions():
    # Drive the same game by hand, one env and explicit resets, and compare every step with the vector env:
    # after an episode end the vector env must return the next episode's first observation, with no extra
    # step in which the action is ignored and the reward is zero.
    seed, steps = 7, 600
    actions = np.random.default_rng(2).integers(4, size=steps)
    vector = ppo.make_vector_env("BreakoutNoFrameskip-v4", 1)
    single = ppo.make_env("BreakoutNoFrameskip-v4")()
    vector_obs, _ = vector.reset(seed=[seed])
    single_obs, _ = single.reset(seed=seed)
    np.testing.assert_array_equal(vector_obs[0], single_obs)
    ends = 0
    for action in actions:
        vector_obs, vector_reward, vector_term, vector_trunc, infos = vector.step(np.array([action]))
        single_obs, single_reward, single_term, single_trunc, _ = single.step(action)
        assert vector_reward[0] == single_reward and vector_term[0] == single_term
        if single_term or single_trunc:
            ends += 1
            np.testing.assert_array_equal(infos["final_obs"][0], single_obs)
            single_obs, _ = single.reset()
        np.testing.assert_array_equal(vector_obs[0], single_obs)
    assert ends >= 2
    vector.close()
    single.close()


def paddle_moves(env_id: str, trials: int = 100) -> list:
    """How far Breakout's paddle (RAM byte 72) moves in one agent step of RIGHT that follows two NOOP steps."""
    env = ppo.make_env(env_id)()
    env.reset(seed=3)
    ram, moves = env.unwrapped.ale.getRAM, []
    for _ in range(trials):
        env.step(0)
        env.step(0)
        before = int(ram()[72])
        _, _, terminated, truncated, _ = env.step(2)
        moves.append(int(ram()[72]) - before)
        env.step(3)  # back LEFT, away from the wall
        env.step(3)
        if terminated or truncated:
            env.reset()
    env.close()
    return moves


def test_ids_run_with_the_sticky_actions_they_register():
    for env_id, sticky in (("BreakoutNoFrameskip-v4", 0.0), ("ALE/Breakout-v5", 0.25)):
        env = ppo.make_env(env_id)()
        env.reset(seed=0)
        frames = env.unwrapped.ale.getEpisodeFrameNumber()
        env.step(0)
        assert env.unwrapped.ale.getEpisodeFrameNumber() - frames == 4  # one agent step is 4 frames, not 16
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == sticky
        env.close()
    assert "no sticky actions" in ppo.protocol("BreakoutNoFrameskip-v4")
    assert "sticky actions 0.25 on every frame" in ppo.protocol("ALE/Breakout-v5")
    # Without sticky actions RIGHT moves the paddle for all 4 frames of a step (9 or more units, 0 at the wall).
    # With v5's, each frame repeats the previous frame's action (NOOP here) with probability 0.25, so the paddle
    # also moves for only 1-3 of the 4 frames (1-8 units), in about 1 - 0.75 - 0.25^4 = 25% of the steps; sticky
    # actions decided once per agent step would move it all 4 frames or none.
    assert not [m for m in paddle_moves("BreakoutNoFrameskip-v4") if 0 < m < 9]
    partial = [m for m in paddle_moves("ALE/Breakout-v5") if 0 < m < 9]
    assert len(partial) >= 10, partial


def test_the_ale_vector_env_runs_the_ids_sticky_actions():
    # The same seeds and actions: a v4 id replays its games exactly, a v5 id's sticky actions change them.
    actions = np.random.default_rng(0).integers(4, size=(200, 2))

    def frames(env_id):
        envs = ppo.AtariVectorGames(env_id, 2, num_threads=1)
        seen = [envs.reset(seed=np.array([5, 6]))[0]] + [envs.step(a)[0] for a in actions]
        envs.close()
        return np.stack(seen)

    assert np.array_equal(frames("BreakoutNoFrameskip-v4"), frames("BreakoutNoFrameskip-v4"))
    assert not np.array_equal(frames("BreakoutNoFrameskip-v4"), frames("ALE/Breakout-v5"))


def test_async_vector_env_matches_sync():
    # --vector-env async steps each env in a subprocess; for the same seeds and actions it must produce
    # exactly what the in-process SyncVectorEnv produces.
    seeds, steps = [11, 12], 400
    actions = np.random.default_rng(3).integers(4, size=(steps, 2))
    runs = []
    for kind in ("sync", "async"):
        envs = ppo.make_vector_env("BreakoutNoFrameskip-v4", 2, kind=kind)
        obs, _ = envs.reset(seed=seeds)
        trajectory = [obs]
        for action in actions:
            obs, reward, terminated, truncated, infos = envs.step(action)
            episodes = infos["final_info"]["episode"]["r"].tolist() if "final_info" in infos and "episode" in infos["final_info"] else []
            trajectory += [obs, reward, terminated, truncated, episodes]
        envs.close()
        runs.append(trajectory)
    assert any(np.any(item) for item in runs[0][3::5])  # episode ends happened along the way
    for sync_item, async_item in zip(*runs):
        np.testing.assert_array_equal(np.asarray(sync_item), np.asarray(async_item))


def test_noop_reset_plays_1_to_30_noops():
    # A new game starts with 1..30 no-op frames (drawn from the env's seed), then FIRE and action 2, one agent
    # step of 4 frames each: the first observation is 9..38 frames into the game, and the count varies.
    frames = []
    for seed in range(40):
        env = ppo.make_env("BreakoutNoFrameskip-v4")()
        env.reset(seed=seed)
        frames.append(env.unwrapped.ale.getEpisodeFrameNumber())
        env.close()
    assert all(1 + 8 <= f <= 30 + 8 for f in frames), frames
    assert frames[4] == 1 + 8 and frames[19] == 30 + 8, frames  # both ends: seed 4 plays 1 no-op, seed 19 plays 30
    assert len(set(frames)) >= 15
