/**
 * The Profile button's state: one capture of the shown job at a time, run by the server
 * (torch.profiler on the chosen ranks for N steps). `start` asks the server to begin; while
 * the capture runs, its state is asked every `pollMs` for the progress; once done, the
 * answer is kept (the slowest rank's top ops next to the median's, the merged trace to
 * download) until another capture starts or another job is shown. A refused start (a
 * capture already running, a bad rank list) is said in one line, and what was shown stays.
 */
import { ISignal, Signal } from '@lumino/signaling';

import { ApiError, CaptureState, IProfileAsk, IProfileState, ProbingApi } from './request';

export const DEFAULT_STEPS = 2;
export const PROFILE_POLL_MS = 500;

/** What the Profile section shows: nothing asked yet, a start on its way, or the capture's state. */
export type ProfilePhase = 'idle' | 'starting' | Exclude<CaptureState, 'none'>;

/** The Profile section's contents, worded from a capture's state. */
export interface IProfileView {
  phase: ProfilePhase;
  /** "2 step(s) on every rank · 1/4 ranks finished, 3 profiling". */
  progress: string;
  /** Ranks finished out of those asked, 0..100. */
  percent: number;
  /** The answer's first line, or why the capture failed. */
  headline: string;
  /** "rank 3: did not finish …", one per rank without a profile. */
  failed: string[];
  /** The comparison's header: op, the slowest rank's ms, the median rank's ms, the difference. */
  columns: string[];
  rows: string[][];
  /** The merged trace, when one was written: its file name, size as text, and what was cut. */
  trace: { name: string; size: string; note: string } | null;
}

function onRanks(ranks: number[] | null): string {
  if (ranks === null) {
    return 'every rank';
  }
  return ranks.length === 1 ? `rank ${ranks[0]}` : `ranks ${ranks.join(',')}`;
}

function ms(value: unknown): string {
  return typeof value === 'number' ? value.toFixed(2) : '';
}

/** "1.2 MB", "840 kB", "512 B". */
export function sizeText(bytes: number): string {
  if (bytes >= 1e6) {
    return `${(bytes / 1e6).toFixed(1)} MB`;
  }
  return bytes >= 1e3 ? `${Math.round(bytes / 1e3)} kB` : `${bytes} B`;
}

/** How the Profile section words a capture's state (null: none asked in this job yet). */
export function profileView(state: IProfileState | null, starting = false): IProfileView {
  const view: IProfileView = {
    phase: 'idle',
    progress: '',
    percent: 0,
    headline: '',
    failed: [],
    columns: [],
    rows: [],
    trace: null
  };
  if (starting) {
    view.phase = 'starting';
    view.progress = 'asking the ranks…';
    return view;
  }
  if (state === null || state.state === 'none') {
    return view;
  }
  view.phase = state.state;
  const asked = `${state.steps ?? '?'} step(s) on ${onRanks(state.ranks)}`;
  const p = state.progress;
  if (state.state === 'running') {
    view.progress = p
      ? `${asked} · ${p.finished}/${p.ranks} ranks finished` +
        (p.running ? `, ${p.running} profiling` : '') +
        (p.armed ? `, ${p.armed} waiting for a step to end (${Math.round(p.waited)} s)` : '')
      : `${asked} · waiting for the ranks`;
    view.percent = p && p.ranks > 0 ? (100 * p.finished) / p.ranks : 0;
    return view;
  }
  if (state.state === 'cancelled') {
    view.headline = `cancelled (${asked})`;
    return view;
  }
  if (state.state === 'failed' || state.result === null) {
    view.phase = 'failed';
    view.headline = state.error ? state.error.message : `the capture failed (${asked})`;
    return view;
  }
  const result = state.result;
  view.headline = result.summary.split('\n')[0];
  view.failed = Object.entries(result.failed)
    .sort(([a], [b]) => Number(a) - Number(b))
    .map(([rank, why]) => `rank ${rank}: ${why}`);
  const comparison = result.comparison;
  if (comparison && comparison.rows.length > 0 && result.slowest_rank !== null) {
    const median = result.median_rank === null ? 'median' : `rank ${result.median_rank}`;
    view.columns = ['op', `rank ${result.slowest_rank} ms`, `${median} ms`, 'extra ms'];
    view.rows = comparison.rows.map(r => [String(r.op ?? ''), ms(r.slowest_ms), ms(r.median_ms), ms(r.extra_ms)]);
  }
  if (result.trace) {
    view.trace = { name: result.trace.name, size: sizeText(result.trace.bytes), note: result.trace.note };
  }
  return view;
}

export interface IProfileModelOptions {
  /** How long to wait between two looks at a running capture. */
  pollMs?: number;
  /** Waits `ms` (tests give a fake). */
  sleep?: (ms: number) => Promise<void>;
}

export class ProfileModel {
  constructor(
    private readonly _api: ProbingApi,
    options: IProfileModelOptions = {}
  ) {
    this._pollMs = options.pollMs ?? PROFILE_POLL_MS;
    this._sleep = options.sleep ?? (ms => new Promise(resolve => setTimeout(resolve, ms)));
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }
  /** The job whose captures are shown (null: none, or one that cannot be profiled). */
  get jobId(): string | null {
    return this._jobId;
  }
  get state(): IProfileState | null {
    return this._state;
  }
  /** The last refused request, as the server said it ("" when none). */
  get error(): string {
    return this._error;
  }
  get starting(): boolean {
    return this._starting;
  }
  /** A capture can be cancelled: the shown one runs, or a start was refused because another
   * capture (started elsewhere: a notebook, the command line) runs in the job. */
  get canCancel(): boolean {
    return this._running() || this._busy;
  }
  get view(): IProfileView {
    return profileView(this._state, this._starting);
  }
  /** Where the shown answer's merged trace downloads from (null when it has none). */
  get traceUrl(): string | null {
    const result = this._state?.result;
    if (this._jobId === null || !result?.trace) {
      return null;
    }
    return this._api.traceUrl(this._jobId, result.capture_id);
  }

  /** Show the captures of `jobId`: its running or last one, followed while it runs. */
  async show(jobId: string | null): Promise<void> {
    if (jobId === this._jobId) {
      return;
    }
    const asked = ++this._asked;
    this._jobId = jobId;
    this._state = null;
    this._error = '';
    this._busy = false;
    this._starting = false;
    this._changed.emit();
    if (jobId === null) {
      return;
    }
    try {
      const state = await this._api.profileState(jobId);
      if (asked === this._asked) {
        this._take(asked, state);
      }
    } catch {
      // the panel's poll says what is wrong with the server or the job; a click asks again
    }
  }

  /** Start a capture of the shown job. */
  async start(ask: IProfileAsk): Promise<void> {
    const jobId = this._jobId;
    if (jobId === null) {
      return;
    }
    const asked = this._asked;
    this._error = '';
    this._busy = false;
    const first = !this._running(); // a second click while one runs: the server says why not
    this._starting = first;
    this._changed.emit();
    try {
      const state = await this._api.profile(jobId, ask);
      if (asked === this._asked) {
        this._starting = false;
        this._take(asked, state);
      }
    } catch (error) {
      if (asked === this._asked) {
        this._starting = false;
        this._error = error instanceof Error ? error.message : String(error);
        this._busy = error instanceof ApiError && error.code === 'busy';
        this._changed.emit();
      }
    }
  }

  /** Cancel the running capture, whoever started it (its ranks stop profiling). */
  async cancel(): Promise<void> {
    const jobId = this._jobId;
    if (jobId === null || !this.canCancel) {
      return;
    }
    const asked = this._asked;
    try {
      const state = await this._api.cancelProfile(jobId);
      if (asked === this._asked) {
        this._busy = false;
        this._error = '';
        this._take(asked, state);
      }
    } catch (error) {
      if (asked === this._asked) {
        this._error = error instanceof Error ? error.message : String(error);
        this._changed.emit();
      }
    }
  }

  dispose(): void {
    this._asked++; // a follow still waiting stops
    Signal.clearData(this);
  }

  private _running(): boolean {
    return this._state?.state === 'running';
  }

  private _take(asked: number, state: IProfileState): void {
    this._state = state;
    this._changed.emit();
    if (state.state === 'running' && this._following !== asked) {
      void this._follow(asked);
    }
  }

  /** Look at the running capture until it ends, or another job is shown. */
  private async _follow(asked: number): Promise<void> {
    this._following = asked; // one follow per shown job
    try {
      while (asked === this._asked && this._running() && this._jobId !== null) {
        await this._sleep(this._pollMs);
        if (asked !== this._asked || this._jobId === null || !this._running()) {
          return; // another job is shown, or the capture ended meanwhile (cancelled)
        }
        let state: IProfileState;
        try {
          state = await this._api.profileState(this._jobId);
        } catch (error) {
          if (asked === this._asked) {
            this._error = error instanceof Error ? error.message : String(error);
            this._changed.emit();
          }
          return; // the panel's poll says what is wrong; the next show or click asks again
        }
        if (asked === this._asked) {
          this._state = state;
          if (state.state !== 'running') {
            this._error = ''; // a start refused while this one ran: no longer news
          }
          this._changed.emit();
        }
      }
    } finally {
      if (this._following === asked) {
        this._following = -1;
      }
    }
  }

  private readonly _pollMs: number;
  private readonly _sleep: (ms: number) => Promise<void>;
  private _changed = new Signal<this, void>(this);
  private _jobId: string | null = null;
  private _state: IProfileState | null = null;
  private _error = '';
  private _starting = false;
  private _busy = false; // the last start was refused: another capture runs in the job
  private _asked = 0;
  private _following = -1;
}
