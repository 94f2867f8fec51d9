/**
 * The panel's model on fixed payloads, with the server's routes replaced by a fake.
 */
import {
  ClusterModel,
  MAX_BACKOFF_MS,
  SLOW_VERDICT_EVERY_MS,
  VERDICT_EVERY_MS,
  jobKind,
  needsVerdict,
  rankGroups,
  stateCounts
} from '../model';
import { ApiError, IJob, IMember, INodes, IProfileState, IStacks, IVerdict, ProbingApi, ServerGone } from '../request';

const VERSION = { api: 2, package: '0.1.0', protocol: 1 };
const VERDICT: IVerdict = {
  summary:
    'Collective #9 on group 0 [default_pg] (all_reduce, [136] float32): ranks 0-2 waiting 41 s; ' +
    'rank 3 never entered it — rank 3 is in fetch_next_batch (train.py:42).',
  findings: [
    { kind: 'missing', ranks: [3], group: '0', seq: 9, detail: 'collective #9 …', evidence: 'last enqueued …' }
  ],
  checked: ['membership of 4 ranks (4 alive)'],
  coverage: { targeted: [0, 1, 2, 3], answered: [0, 1, 2, 3], failed: {}, partial: false },
  healthy: false,
  now: 2000
};

const NO_CAPTURE: IProfileState = {
  state: 'none',
  job_id: 'A',
  ranks: null,
  steps: null,
  started: null,
  ended: null,
  progress: null,
  result: null,
  error: null,
  now: 2000
};

function job(id: string, extra: Partial<IJob> = {}): IJob {
  return {
    id,
    source: 'local',
    target: 'tcp://127.0.0.1:5000',
    run_id: id,
    endpoint: 'tcp://127.0.0.1:5000',
    world_size: 4,
    pid: 100,
    host: 'h0',
    started: 1000,
    alive: true,
    added: null,
    restarts: 0,
    store: null,
    ...extra
  };
}

function member(rank: number, node: number, extra: Partial<IMember> = {}): IMember {
  return {
    rank,
    world_size: 4,
    local_rank: rank % 2,
    local_world_size: 2,
    node,
    node_count: 2,
    host: `h${node}`,
    endpoint: `tcp://h${node}:60${rank}0`,
    pid: 200 + rank,
    role: 'trainer',
    incarnation: `9f${rank}a`,
    state: 'alive',
    last_seen: 1999.6,
    since: 1000,
    step: 41,
    step_time_ms: 200,
    compute_ms: 150,
    comm_wait_ms: 50,
    tier: 'leaf',
    parent: null,
    level: null,
    reason: null,
    via: null,
    ratio: 1,
    bar: 0.5,
    slow: false,
    age: '0.4 s',
    state_for: '',
    ...extra
  };
}

function nodes(jobId: string, extra: Partial<INodes> = {}): INodes {
  return {
    job_id: jobId,
    run_id: jobId,
    world_size: 4,
    info: { run_id: jobId, world_size: 4 },
    epoch: 1,
    members: [member(0, 0), member(1, 0), member(2, 1), member(3, 1)],
    departures: [],
    suspects: [],
    now: 2000,
    restarts: 0,
    restart_notice: null,
    ...extra
  };
}

function stacks(rank: number, file: string): IStacks {
  const group = {
    ranks: [rank],
    label: String(rank),
    thread: 'MainThread',
    frames: [{ function: 'f', file, line: 1 }]
  };
  const coverage = { targeted: [rank], answered: [rank], failed: {}, partial: false };
  return { groups: [group], ranks: { [String(rank)]: group }, coverage, footer: '1 of 1 ranks' };
}

/** A promise the test settles when it wants: a reply still on its way. */
function later<T>(): { promise: Promise<T>; resolve: (v: T) => void; reject: (e: unknown) => void } {
  let resolve!: (v: T) => void;
  let reject!: (e: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

type Fake = { [K in keyof ProbingApi]: jest.Mock };

function fakeApi(jobs: IJob[] = [job('A')]): Fake {
  return {
    version: jest.fn(async () => VERSION),
    jobs: jest.fn(async () => ({ jobs, now: 2000 })),
    addJob: jest.fn(),
    removeJob: jest.fn(async () => undefined),
    nodes: jest.fn(async (id: string) => nodes(id)),
    stacks: jest.fn(),
    diagnose: jest.fn(async () => VERDICT),
    profile: jest.fn(),
    profileState: jest.fn(async (id: string) => ({ ...NO_CAPTURE, job_id: id })),
    cancelProfile: jest.fn(),
    traceUrl: jest.fn((id: string, capture: string) => `/probing/api/jobs/${id}/profile/trace?capture=${capture}`)
  };
}

function started(api: Fake, chosen: string | null = null): ClusterModel {
  const model = new ClusterModel({ api: api as unknown as ProbingApi, intervalSeconds: 60 });
  model.visible = true;
  model.start(chosen);
  return model;
}

/** Let every pending promise and zero-delay timer run (real timers). */
async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) {
    await new Promise(resolve => setTimeout(resolve, 0));
  }
}

const models: ClusterModel[] = [];
afterEach(() => {
  models.splice(0).forEach(m => m.dispose());
  jest.useRealTimers();
  jest.restoreAllMocks();
});

function track(model: ClusterModel): ClusterModel {
  models.push(model);
  return model;
}

describe('the verdict banner', () => {
  const stalled = (id: string) =>
    nodes(id, { members: [member(0, 0), member(1, 0), member(2, 1), member(3, 1, { state: 'stalled' })] });

  it('is asked while a rank is stalled or dead at most every VERDICT_EVERY_MS, else every SLOW_VERDICT_EVERY_MS', async () => {
    const api = fakeApi();
    api.diagnose.mockResolvedValueOnce({ ...VERDICT, healthy: true, findings: [], summary: 'No straggler.' });
    const model = track(started(api));
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(1); // why is it slow, asked of a running job
    expect(model.verdict?.summary).toBe('No straggler.');
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(1); // not again within SLOW_VERDICT_EVERY_MS

    api.nodes.mockImplementation(async (id: string) => stalled(id));
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(2); // a rank stalled: asked at once
    expect(api.diagnose).toHaveBeenLastCalledWith('A');
    expect(model.verdict?.summary).toBe(VERDICT.summary);

    await model.refresh(); // within VERDICT_EVERY_MS: not asked again
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(2);
    const now = Date.now();
    jest.spyOn(Date, 'now').mockReturnValue(now + VERDICT_EVERY_MS + 1);
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(3);

    api.nodes.mockImplementation(async (id: string) => nodes(id)); // every rank alive again
    api.diagnose.mockImplementation(() => new Promise(() => undefined)); // the slow verdict still on its way
    await model.refresh();
    expect(model.verdict).toBeNull(); // the hang verdict is over
    expect(api.diagnose).toHaveBeenCalledTimes(4); // and why it is slow is asked anew
    jest.spyOn(Date, 'now').mockReturnValue(now + VERDICT_EVERY_MS + SLOW_VERDICT_EVERY_MS - 1);
    await model.refresh();
    expect(api.diagnose).toHaveBeenCalledTimes(4);
  });

  it('drops a verdict that arrives after the job changed, and survives a failing one', async () => {
    const api = fakeApi([job('A'), job('B')]);
    api.nodes.mockImplementation(async (id: string) => stalled(id));
    const fromA = later<IVerdict>();
    api.diagnose.mockReturnValueOnce(fromA.promise).mockRejectedValueOnce(new ApiError(504, 'timeout', 'slow'));
    const model = track(started(api, 'A'));
    await model.refresh();
    expect(api.diagnose).toHaveBeenLastCalledWith('A');
    model.choose('B');
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenLastCalledWith('B');
    fromA.resolve(VERDICT);
    await settle();
    expect(model.job?.id).toBe('B');
    expect(model.verdict).toBeNull(); // A's verdict does not land under B, B's failed
  });

  it('is asked once for an ended job read from its dumps, although no rank is stalled or dead', async () => {
    const dumps = job('dump-1', { source: 'dump', alive: false, target: 'dump:///d/run', endpoint: null, pid: null });
    const api = fakeApi([job('A'), dumps]);
    api.diagnose.mockRejectedValueOnce(new ApiError(504, 'timeout', 'slow')).mockResolvedValue(VERDICT);
    const model = track(started(api, 'dump-1'));
    await model.refresh();
    await settle();
    expect(jobKind(model.job!)).toBe('dumps');
    expect(model.status).toBe('ready'); // its ranks as last seen, not "ended; waiting for a relaunch"
    expect(api.diagnose).toHaveBeenCalledTimes(1);
    expect(model.verdict).toBeNull(); // that one failed: asked again after VERDICT_EVERY_MS
    const now = Date.now();
    jest.spyOn(Date, 'now').mockReturnValue(now + VERDICT_EVERY_MS + 1);
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(2);
    expect(model.verdict?.summary).toBe(VERDICT.summary);
    jest.spyOn(Date, 'now').mockReturnValue(now + 10 * VERDICT_EVERY_MS);
    await model.refresh();
    await settle();
    expect(api.diagnose).toHaveBeenCalledTimes(2); // the dumps do not change: one verdict
    expect(api.diagnose).toHaveBeenLastCalledWith('dump-1');
  });

  it('needs a stalled or dead rank', () => {
    expect(needsVerdict(nodes('A'))).toBe(false);
    expect(needsVerdict(stalled('A'))).toBe(true);
    expect(needsVerdict(nodes('A', { members: [member(0, 0, { state: 'dead' })] }))).toBe(true);
  });
});

describe('the stack of a rank', () => {
  it('keeps a reply only for the job and rank it was asked for', async () => {
    const api = fakeApi([job('A'), job('B')]);
    const model = track(started(api, 'A'));
    await model.refresh();
    expect(model.job?.id).toBe('A');

    const fromA = later<IStacks>();
    api.stacks.mockReturnValueOnce(fromA.promise);
    const asked = model.selectRank(3);
    expect(api.stacks).toHaveBeenLastCalledWith('A', '3');

    model.choose('B'); // the user switches jobs while rank 3 of A is on its way
    await model.refresh();
    expect(model.job?.id).toBe('B');
    const fromB = later<IStacks>();
    api.stacks.mockReturnValueOnce(fromB.promise);
    const askedB = model.selectRank(3);
    expect(api.stacks).toHaveBeenLastCalledWith('B', '3');

    fromA.resolve(stacks(3, '/a/train_a.py'));
    await asked;
    expect(model.selectedRank).toBe(3);
    expect(model.stack).toBeNull(); // rank 3 of A does not land under B
    expect(model.stackMessage).toContain('loading');

    fromB.reject(new ApiError(504, 'timeout', 'rank 3 did not answer in time'));
    await askedB;
    expect(model.stack).toBeNull();
    expect(model.stackMessage).toBe('rank 3 did not answer in time');
  });

  it('clears a shown stack when the next request for it fails', async () => {
    const api = fakeApi();
    const model = track(started(api));
    await model.refresh();
    api.stacks.mockResolvedValueOnce(stacks(2, '/w/tiny_ddp.py'));
    await model.selectRank(2);
    expect(model.stack?.frames[0].file).toBe('/w/tiny_ddp.py');
    expect(model.stackMessage).toBe('');

    api.stacks.mockRejectedValueOnce(new ApiError(502, 'job_unreachable', 'job A unreachable'));
    await model.selectRank(2);
    expect(model.stack).toBeNull();
    expect(model.stackMessage).toBe('job A unreachable');
  });

  it('shows the latest of two clicks, whatever order the replies come in', async () => {
    const api = fakeApi();
    const model = track(started(api));
    await model.refresh();
    const one = later<IStacks>();
    const two = later<IStacks>();
    api.stacks.mockReturnValueOnce(one.promise).mockReturnValueOnce(two.promise);
    const first = model.selectRank(1);
    const second = model.selectRank(2);
    two.resolve(stacks(2, '/w/two.py'));
    await second;
    one.resolve(stacks(1, '/w/one.py'));
    await first;
    expect(model.selectedRank).toBe(2);
    expect(model.stack?.frames[0].file).toBe('/w/two.py');
  });

  it('drops a reply that arrives after the job changed', async () => {
    const api = fakeApi([job('A'), job('B')]);
    const model = track(started(api, 'A'));
    await model.refresh();
    const reply = later<IStacks>();
    api.stacks.mockReturnValueOnce(reply.promise);
    const asked = model.selectRank(0);
    model.choose('B');
    reply.resolve(stacks(0, '/a/train_a.py'));
    await asked;
    expect(model.selectedRank).toBeNull();
    expect(model.stack).toBeNull();
    expect(model.stackMessage).toBe('');
  });

  it('says when the rank did not answer', async () => {
    const api = fakeApi();
    const model = track(started(api));
    await model.refresh();
    api.stacks.mockResolvedValueOnce({ groups: [], ranks: {}, footer: '0 of 1 ranks answered' });
    await model.selectRank(1);
    expect(model.stack).toBeNull();
    expect(model.stackMessage).toBe('rank 1 did not answer (0 of 1 ranks answered)');
  });
});

describe('choosing a job', () => {
  it('shows the newest job unless one was chosen, and follows a new choice', async () => {
    const api = fakeApi([job('new'), job('old')]);
    const model = track(started(api));
    await model.refresh();
    expect(model.job?.id).toBe('new');
    expect(model.nodes?.job_id).toBe('new');
    expect(model.status).toBe('ready');

    const chosen: (string | null)[] = [];
    model.chosenChanged.connect((_, id) => chosen.push(id));
    model.choose('old');
    expect(model.nodes).toBeNull(); // the previous job's ranks are gone at once
    await model.refresh();
    expect(model.job?.id).toBe('old');
    expect(model.nodes?.job_id).toBe('old');
    expect(chosen).toEqual(['old']);
  });

  it('does not show a job left while its answer was on its way', async () => {
    const api = fakeApi([job('A'), job('B')]);
    const model = track(started(api, 'A'));
    await model.refresh();
    const slowA = later<INodes>();
    api.nodes.mockReturnValueOnce(slowA.promise);
    const tick = model.refresh(); // asks A's nodes, which take their time
    await settle();
    expect(api.nodes).toHaveBeenLastCalledWith('A');
    model.choose('B'); // asks B at once, not after A's answer and another interval
    await settle();
    expect(api.nodes).toHaveBeenLastCalledWith('B');
    expect(model.nodes?.job_id).toBe('B');
    slowA.resolve(nodes('A', { members: [member(0, 0, { state: 'dead' })] }));
    await tick;
    await settle();
    expect(model.job?.id).toBe('B');
    expect(model.nodes?.job_id).toBe('B');
  });

  it('says so when no job runs', async () => {
    const api = fakeApi([]);
    const model = track(started(api));
    await model.refresh();
    expect(model.status).toBe('no-job');
    expect(model.message).toContain('No job found');
    expect(model.nodes).toBeNull();
  });

  it('falls back to the newest job when the chosen one is gone, and forgets the old ranks', async () => {
    const api = fakeApi([job('A'), job('B')]);
    const model = track(started(api, 'B'));
    await model.refresh();
    api.stacks.mockResolvedValueOnce(stacks(1, '/b/x.py'));
    await model.selectRank(1);
    api.jobs.mockResolvedValue({ jobs: [job('A')], now: 2000 });
    await model.refresh();
    expect(model.job?.id).toBe('A');
    expect(model.selectedRank).toBeNull();
    expect(model.stack).toBeNull();
  });
});

describe('a job that ends and is launched again', () => {
  it('stays shown, ended, waiting for a relaunch', async () => {
    const api = fakeApi([job('A')]);
    const model = track(started(api));
    await model.refresh();
    api.jobs.mockResolvedValue({ jobs: [job('B'), job('A', { alive: false })], now: 2000 });
    api.nodes.mockImplementation(async (id: string) => {
      if (id === 'A') {
        throw new ApiError(502, 'job_ended', 'job A has ended: its root (pid 100) exited');
      }
      return nodes(id);
    });
    await model.refresh();
    expect(model.job?.id).toBe('A'); // not the newer B: the ended job stays shown
    expect(model.status).toBe('job-ended');
    expect(model.message).toBe('job A has ended: its root (pid 100) exited; waiting for a relaunch (same run id)');
    expect(model.nodes).toBeNull();
  });

  it('says once that it restarted, also when first met while ended', async () => {
    const api = fakeApi([job('A', { alive: false, restarts: 1 })]);
    api.nodes.mockRejectedValue(new ApiError(502, 'job_ended', 'job A has ended'));
    const model = track(started(api, 'A'));
    await model.refresh();
    expect(model.status).toBe('job-ended');
    expect(model.notice).toBe('');

    const notice = 'job A restarted: following its new launch (restart 2)';
    api.jobs.mockResolvedValue({ jobs: [job('A', { restarts: 2 })], now: 2000 });
    api.nodes.mockResolvedValue(nodes('A', { restarts: 2, restart_notice: notice }));
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(model.notice).toBe(notice);
    model.dismissNotice();
    expect(model.notice).toBe('');
    await model.refresh();
    expect(model.notice).toBe(''); // the same relaunch is not news twice
  });

  it('does not call a relaunch it saw before the panel met the job news', async () => {
    const api = fakeApi([job('A', { restarts: 3 })]);
    api.nodes.mockResolvedValue(nodes('A', { restarts: 3, restart_notice: 'job A restarted: …' }));
    const model = track(started(api));
    await model.refresh();
    expect(model.status).toBe('ready');
    expect(model.notice).toBe('');
  });

  it('tells an unreachable job from a gone server', async () => {
    const api = fakeApi();
    api.nodes.mockRejectedValue(new ApiError(504, 'timeout', 'the root did not answer in 5 s'));
    const model = track(started(api));
    await model.refresh();
    expect(model.status).toBe('job-unreachable');
    expect(model.message).toBe('Job A unreachable: the root did not answer in 5 s');
    expect(model.pollState.phase).not.toBe('rejected'); // the server is fine: no backoff
  });
});

describe('the server extension', () => {
  it('says plainly when it is missing or of another version', async () => {
    const api = fakeApi();
    api.version.mockResolvedValueOnce({ ...VERSION, api: 3, package: '9.0.0' });
    const model = track(started(api));
    await model.refresh();
    expect(model.status).toBe('no-extension');
    expect(model.message).toContain('API 3, package 9.0.0');
    expect(api.jobs).not.toHaveBeenCalled();

    api.version.mockRejectedValueOnce(new ApiError(404, 'no_route', '404 Not Found for version'));
    await model.refresh();
    expect(model.status).toBe('no-extension');
    expect(model.message).toContain('server extension is missing');
  });
});

describe('backoff while the server is gone', () => {
  it('waits longer after each failure, up to 15 s, asks only the version, and resumes', async () => {
    jest.useFakeTimers();
    jest.spyOn(Math, 'random').mockReturnValue(0.999999); // the longest wait the backoff allows
    const api = fakeApi();
    const model = track(new ClusterModel({ api: api as unknown as ProbingApi, intervalSeconds: 2 }));
    model.visible = true;
    model.start();
    await jest.advanceTimersByTimeAsync(0);
    expect(model.status).toBe('ready');
    expect(model.pollState.interval).toBe(2000);

    api.version.mockRejectedValue(new ServerGone('the Jupyter server does not answer'));
    api.jobs.mockRejectedValue(new ServerGone('the Jupyter server does not answer'));
    await jest.advanceTimersByTimeAsync(2000); // the jobs listing fails: the server is gone
    expect(model.status).toBe('server-gone');
    expect(model.pollState.phase).toBe('rejected');
    const jobsAsked = api.jobs.mock.calls.length;

    const waits: number[] = [model.pollState.interval];
    for (let i = 0; i < 5; i++) {
      await jest.advanceTimersByTimeAsync(model.pollState.interval);
      waits.push(model.pollState.interval);
    }
    expect(waits).toEqual([4000, 8000, MAX_BACKOFF_MS, MAX_BACKOFF_MS, MAX_BACKOFF_MS, MAX_BACKOFF_MS]);
    expect(api.jobs.mock.calls.length).toBe(jobsAsked); // only the version route is pinged meanwhile
    expect(model.status).toBe('server-gone');

    api.version.mockResolvedValue(VERSION);
    api.jobs.mockResolvedValue({ jobs: [job('A')], now: 2000 });
    await jest.advanceTimersByTimeAsync(MAX_BACKOFF_MS);
    expect(model.status).toBe('ready');
    expect(model.pollState.phase).toBe('reconnected');
    expect(model.pollState.interval).toBe(2000); // back to the normal pace
  });

  it('takes any interval the settings allow, also one longer than the backoff cap', () => {
    const model = track(new ClusterModel({ api: fakeApi() as unknown as ProbingApi }));
    expect(() => {
      model.intervalSeconds = 0.5;
      model.intervalSeconds = 60;
    }).not.toThrow();
  });

  it('stands by while the panel is hidden', async () => {
    jest.useFakeTimers();
    const api = fakeApi();
    const model = track(new ClusterModel({ api: api as unknown as ProbingApi, intervalSeconds: 2 }));
    model.start();
    await jest.advanceTimersByTimeAsync(10_000);
    expect(api.jobs).not.toHaveBeenCalled();
    model.visible = true;
    await jest.advanceTimersByTimeAsync(0);
    expect(api.jobs).toHaveBeenCalledTimes(1);
  });
});

describe('what the panel renders of a nodes answer', () => {
  const payload = nodes('A', {
    members: [
      member(3, 1, {
        state: 'stalled',
        step: 40,
        step_time_ms: 410.4,
        ratio: 2.05,
        bar: 1,
        slow: true,
        age: '12 s',
        state_for: '75 s',
        reason: 'in fetch_next_batch (train.py:42)'
      }),
      member(1, 0, { step_time_ms: 201.2, ratio: 1.005, bar: 0.5025, age: '0.4 s' }),
      member(2, 1, { state: 'dead', step: null, step_time_ms: null, ratio: null, bar: null, age: '3 min' }),
      member(0, 0, { role: null, step_time_ms: 199.1, ratio: 0.995, bar: 0.4975, last_seen: null, age: null }),
      member(4, 2, { state: 'joining', reason: 'since 2 s', step_time_ms: null, ratio: null, bar: null })
    ],
    suspects: [{ ranks: [3], where: 'fetch_next_batch', others: 0, others_where: '', text: 'suspect: rank 3' }]
  });

  it('groups ranks by node, in order, with the server’s bar, slow mark and age', () => {
    const groups = rankGroups(payload);
    expect(groups.map(g => [g.node, g.host, g.ranks.map(r => r.rank)])).toEqual([
      [0, 'h0', [0, 1]],
      [1, 'h1', [2, 3]],
      [2, 'h2', [4]]
    ]);
    const [r0, r1] = groups[0].ranks;
    const [r2, r3] = groups[1].ranks;
    expect(r0).toMatchObject({ state: 'alive', role: '', step: '41', seen: '—', ms: '199', slow: false });
    expect(r0.barPercent).toBeCloseTo(49.75);
    expect(r1).toMatchObject({ seen: '0.4 s', ms: '201', ratio: '1.00x the median', suspect: false });
    expect(r2).toMatchObject({ state: 'dead', step: '—', seen: '3 min', ms: '', barPercent: 0, ratio: '' });
    expect(r3).toMatchObject({ state: 'stalled', seen: '12 s', ms: '410', barPercent: 100, slow: true });
    expect(r3).toMatchObject({ suspect: true, ratio: '2.05x the median' });
    expect(r0.detail).toBe('alive · pid 200 · tcp://h0:6000');
    expect(groups[2].ranks[0].detail).toBe('joining since 2 s');
    expect(r3.detail).toBe('stalled for 75 s in fetch_next_batch (train.py:42)'); // stalled since its last progress
  });

  it('shows no age before a rank reported and never draws a bar past its track', () => {
    const [group] = rankGroups(nodes('A', { members: [member(0, 0, { age: null, bar: 1.7 })] }));
    expect(group.ranks[0].seen).toBe('—');
    expect(group.ranks[0].barPercent).toBe(100);
  });

  it('counts every state, the usual ones also when none is in them', () => {
    expect(stateCounts(payload)).toEqual([
      ['alive', 2],
      ['stalled', 1],
      ['dead', 1],
      ['joining', 1]
    ]);
    expect(stateCounts(nodes('A', { members: [] }))).toEqual([
      ['alive', 0],
      ['stalled', 0],
      ['dead', 0]
    ]);
  });
});

describe('jobs and their profile captures', () => {
  it('words a job as running, ended (waiting for a relaunch) or read from its dumps', () => {
    expect(jobKind(job('A'))).toBe('running');
    expect(jobKind(job('A', { alive: null, source: 'added' }))).toBe('running');
    expect(jobKind(job('A', { alive: false }))).toBe('ended');
    expect(jobKind(job('d', { source: 'dump', alive: false }))).toBe('dumps');
  });

  it('shows the captures of a running job only, and those of the job shown', async () => {
    const dumps = job('dump-1', { source: 'dump', alive: false });
    const api = fakeApi([job('A'), job('B'), dumps]);
    const model = track(started(api, 'A'));
    await model.refresh();
    await settle();
    expect(model.profile.jobId).toBe('A');
    expect(api.profileState).toHaveBeenLastCalledWith('A');
    model.choose('dump-1');
    await model.refresh();
    await settle();
    expect(model.profile.jobId).toBeNull(); // an ended job cannot be profiled: no button
    model.choose('B');
    await model.refresh();
    await settle();
    expect(model.profile.jobId).toBe('B');
    expect(api.profileState).toHaveBeenCalledTimes(2);
  });
});
