/**
 * The Profile button's model and wording, with the server's routes replaced by a fake and
 * the wait between two looks at a running capture under the test's control.
 */
import { ProfileModel, profileView, sizeText } from '../profile';
import { ApiError, IProfileResult, IProfileState, ProbingApi } from '../request';

function state(extra: Partial<IProfileState> = {}): IProfileState {
  return {
    state: 'running',
    job_id: 'A',
    ranks: null,
    steps: 2,
    started: 1000,
    ended: null,
    progress: { finished: 0, ranks: 4, running: 0, armed: 0, waited: 0 },
    result: null,
    error: null,
    now: 1001,
    ...extra
  };
}

const RESULT: IProfileResult = {
  capture_id: 'c0ffee',
  ranks: [0, 1, 2, 3],
  steps: 2,
  status: { '0': { state: 'done' }, '1': { state: 'done' }, '2': { state: 'done' }, '3': { state: 'failed' } },
  failed: { '3': 'no answer during the capture: rank 3 is dead' },
  slowest_rank: 2,
  median_rank: 1,
  comparison: {
    columns: ['op', 'slowest_ms', 'median_ms', 'extra_ms'],
    rows: [
      { op: 'aten::straggle', slowest_ms: 40.5, median_ms: 0, extra_ms: 40.5 },
      { op: 'aten::addmm', slowest_ms: 3.25, median_ms: 3, extra_ms: 0.25 }
    ]
  },
  op_rows: 120,
  summary: 'profile c0ffee: 3/4 ranks profiled 2 step(s)\n  rank 3: no answer',
  trace: { name: 'probing-profile-c0ffee.json', bytes: 1_234_567, note: '' },
  offsets_ms: { '0': 0, '1': 0, '2': 0 }
};

const DONE = state({
  state: 'done',
  ended: 1005,
  progress: { finished: 4, ranks: 4, running: 0, armed: 0, waited: 3 },
  result: RESULT
});

type Fake = { [K in keyof ProbingApi]: jest.Mock };

function fakeApi(): Fake {
  return {
    version: jest.fn(),
    jobs: jest.fn(),
    addJob: jest.fn(),
    removeJob: jest.fn(),
    nodes: jest.fn(),
    stacks: jest.fn(),
    diagnose: jest.fn(),
    profile: jest.fn(async () => state()),
    profileState: jest.fn(async (id: string) => state({ state: 'none', job_id: id, progress: null, steps: null })),
    cancelProfile: jest.fn(async () => state({ state: 'cancelled', ended: 1002 })),
    traceUrl: jest.fn((id: string, capture: string) => `/probing/api/jobs/${id}/profile/trace?capture=${capture}`)
  };
}

/** Waits the model asks for, released one at a time by the test. */
function manualSleep(): { sleep: (ms: number) => Promise<void>; release: () => Promise<void>; waiting: () => number } {
  const pending: (() => void)[] = [];
  return {
    sleep: () => new Promise<void>(resolve => pending.push(resolve)),
    release: async () => {
      pending.shift()?.();
      await settle();
    },
    waiting: () => pending.length
  };
}

async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) {
    await new Promise(resolve => setTimeout(resolve, 0));
  }
}

describe('profileView', () => {
  it('words nothing before a capture, then the progress of a running one', () => {
    expect(profileView(null).phase).toBe('idle');
    expect(profileView(state({ state: 'none' })).phase).toBe('idle');
    expect(profileView(null, true)).toMatchObject({ phase: 'starting', progress: 'asking the ranks…' });
    const running = profileView(
      state({ ranks: [0, 2], progress: { finished: 1, ranks: 2, running: 1, armed: 0, waited: 1 } })
    );
    expect(running).toMatchObject({ phase: 'running', percent: 50 });
    expect(running.progress).toBe('2 step(s) on ranks 0,2 · 1/2 ranks finished, 1 profiling');
    expect(profileView(state({ progress: null })).progress).toBe('2 step(s) on every rank · waiting for the ranks');
  });

  it('words the answer: the slowest rank next to the median, who failed, the trace', () => {
    const view = profileView(DONE);
    expect(view.phase).toBe('done');
    expect(view.headline).toBe('profile c0ffee: 3/4 ranks profiled 2 step(s)');
    expect(view.failed).toEqual(['rank 3: no answer during the capture: rank 3 is dead']);
    expect(view.columns).toEqual(['op', 'rank 2 ms', 'rank 1 ms', 'extra ms']);
    expect(view.rows[0]).toEqual(['aten::straggle', '40.50', '0.00', '40.50']);
    expect(view.trace).toEqual({ name: 'probing-profile-c0ffee.json', size: '1.2 MB', note: '' });
    const none = profileView({ ...DONE, result: { ...RESULT, comparison: null, slowest_rank: null, trace: null } });
    expect(none.rows).toEqual([]);
    expect(none.trace).toBeNull();
  });

  it('words a failed or cancelled capture in one line', () => {
    const failed = state({ state: 'failed', error: { status: 502, code: 'job_ended', message: 'job x has ended' } });
    expect(profileView(failed)).toMatchObject({ phase: 'failed', headline: 'job x has ended' });
    expect(profileView(state({ state: 'cancelled' }))).toMatchObject({
      phase: 'cancelled',
      headline: 'cancelled (2 step(s) on every rank)'
    });
  });

  it('says sizes in B, kB and MB', () => {
    expect([sizeText(512), sizeText(840_200), sizeText(12_345_678)]).toEqual(['512 B', '840 kB', '12.3 MB']);
  });
});

describe('ProfileModel', () => {
  it('starts a capture, follows it while it runs, then keeps its answer and trace link', async () => {
    const api = fakeApi();
    const clock = manualSleep();
    const model = new ProfileModel(api as unknown as ProbingApi, { sleep: clock.sleep });
    await model.show('A');
    expect(model.view.phase).toBe('idle');
    expect(model.traceUrl).toBeNull();

    const started = model.start({ steps: 3, ranks: '0-1' });
    expect(model.view.phase).toBe('starting');
    await started;
    expect(api.profile).toHaveBeenCalledWith('A', { steps: 3, ranks: '0-1' });
    expect(model.view.phase).toBe('running');
    expect(clock.waiting()).toBe(1);

    api.profileState.mockResolvedValueOnce(
      state({ progress: { finished: 2, ranks: 4, running: 2, armed: 0, waited: 2 } })
    );
    await clock.release();
    expect(model.view.percent).toBe(50);
    api.profileState.mockResolvedValueOnce(DONE);
    await clock.release();
    expect(model.view.phase).toBe('done');
    expect(clock.waiting()).toBe(0); // no more looks once it ended
    expect(model.traceUrl).toBe('/probing/api/jobs/A/profile/trace?capture=c0ffee');
    model.dispose();
  });

  it('says a refused second start in one line, and keeps following the running capture', async () => {
    const api = fakeApi();
    const clock = manualSleep();
    const model = new ProfileModel(api as unknown as ProbingApi, { sleep: clock.sleep });
    await model.show('A');
    await model.start({ steps: 2, ranks: null });
    const busy = 'a capture is already running in job A (2 step(s) on every rank, started 1 s ago)';
    api.profile.mockRejectedValueOnce(new ApiError(409, 'busy', busy));
    const second = model.start({ steps: 2, ranks: null });
    expect(model.view.phase).toBe('running'); // not "starting": the first capture is still what is shown
    await second;
    expect(model.error).toBe(busy);
    expect(model.view.phase).toBe('running');
    expect(clock.waiting()).toBe(1); // one follow, not two
    api.profileState.mockResolvedValueOnce(DONE);
    await clock.release();
    expect(model.view.phase).toBe('done');
    expect(model.error).toBe(''); // the refusal was about the capture that ended
    model.dispose();
  });

  it('shows a capture running when it meets the job (after a reload), and cancels it', async () => {
    const api = fakeApi();
    const clock = manualSleep();
    api.profileState.mockResolvedValueOnce(state());
    const model = new ProfileModel(api as unknown as ProbingApi, { sleep: clock.sleep });
    await model.show('A');
    expect(model.view.phase).toBe('running');
    expect(clock.waiting()).toBe(1);
    await model.cancel();
    expect(api.cancelProfile).toHaveBeenCalledWith('A');
    expect(model.view.phase).toBe('cancelled');
    await clock.release();
    expect(api.profileState).toHaveBeenCalledTimes(1); // ended: not looked at again
    model.dispose();
  });

  it('cancels a capture it did not start once the server says one runs', async () => {
    const api = fakeApi();
    const model = new ProfileModel(api as unknown as ProbingApi, { sleep: manualSleep().sleep });
    await model.show('A');
    expect(model.canCancel).toBe(false);
    api.profile.mockRejectedValueOnce(new ApiError(409, 'busy', 'a capture is already running in this job'));
    await model.start({ steps: 2, ranks: null });
    expect(model.view.phase).toBe('idle');
    expect(model.canCancel).toBe(true); // started elsewhere: still ours to cancel
    api.cancelProfile.mockResolvedValueOnce(state({ state: 'none', progress: null, steps: null }));
    await model.cancel();
    expect(api.cancelProfile).toHaveBeenCalledWith('A');
    expect(model.error).toBe('');
    expect(model.canCancel).toBe(false);
    model.dispose();
  });

  it('says what a capture waits for when no step ends', () => {
    const waiting = state({ progress: { finished: 0, ranks: 4, running: 0, armed: 4, waited: 12.4 } });
    expect(profileView(waiting).progress).toBe(
      '2 step(s) on every rank · 0/4 ranks finished, 4 waiting for a step to end (12 s)'
    );
  });

  it('drops what arrives for a job no longer shown, and follows the capture of the new one', async () => {
    const api = fakeApi();
    const clock = manualSleep();
    const model = new ProfileModel(api as unknown as ProbingApi, { sleep: clock.sleep });
    await model.show('A');
    await model.start({ steps: 2, ranks: null }); // A's capture runs, its follow waits
    api.profileState.mockResolvedValueOnce(state({ job_id: 'B', steps: 5 }));
    await model.show('B');
    expect(model.state?.job_id).toBe('B');
    await clock.release(); // A's follow wakes up: it stops
    api.profileState.mockResolvedValueOnce(state({ ...DONE, job_id: 'B' }));
    await clock.release(); // B's follow
    expect(model.state?.job_id).toBe('B');
    expect(model.view.phase).toBe('done');
    expect(api.profileState.mock.calls.map(c => c[0])).toEqual(['A', 'B', 'B']);
    await model.show(null);
    expect(model.state).toBeNull();
    expect(model.traceUrl).toBeNull();
    model.dispose();
  });
});
