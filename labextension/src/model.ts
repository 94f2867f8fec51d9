/**
 * The Probing panel's state and its one poll. Views only read from here and call its
 * methods; they re-render on `changed`.
 *
 * Each tick: check the server extension's version (once, and again after the server
 * was gone), list the jobs, keep the chosen one (or the newest), fetch its nodes.
 * A job that ended stays shown ("ended; waiting for a relaunch": the server keeps it
 * listed, not alive, while the panel asks for it); launched again with the same run id
 * it has the same id, so the panel shows the new launch and says once that it restarted
 * (the server counts the relaunches it saw: `restarts`; the panel counts from the first
 * time it meets the job, in the listing, so a panel opened or reloaded while the job is
 * ended still says so when it comes back).
 * A tick that cannot reach the Jupyter server rejects, so the lumino `Poll` backs off
 * and only pings the version route until the server answers again. The poll stands by
 * while the panel is hidden or the browser tab is in the background.
 * While a rank of the shown job is stalled or dead, the verdict (why it is stuck) is asked
 * beside the poll, at most every VERDICT_EVERY_MS, and shown as a banner; while every rank
 * is alive, every SLOW_VERDICT_EVERY_MS (why it is slow: a straggler is shown the same way).
 * A job added by its dumps (`dump://DIR`) has ended for good: its ranks are shown as last
 * seen, and its verdict (who failed first, and why) is asked once.
 * The shown job's profile captures are `profile`'s (a running job only).
 */
import { IPoll, Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { ProfileModel } from './profile';
import {
  API_VERSION,
  ApiError,
  IJob,
  INodes,
  IStackGroup,
  IVerdict,
  IVersion,
  ProbingApi,
  ServerGone,
  api
} from './request';

export type Status =
  | 'starting'
  | 'no-extension' // the probing routes are missing or speak another API version
  | 'server-gone' // the Jupyter server does not answer
  | 'no-job' // nothing running on the server's machine, nothing added
  | 'job-ended' // the shown job's root is gone; waiting for it to be launched again
  | 'job-unreachable' // the chosen job did not answer or refused us
  | 'error'
  | 'ready';

export const MAX_BACKOFF_MS = 15_000;
const BACKOFF_FACTOR = 2; // after an error the next tick waits up to 2x longer, at most 15 s

/** While a rank is stalled or dead: how often the verdict is asked again. */
export const VERDICT_EVERY_MS = 10_000;
/** While every rank is alive: how often the verdict is asked (why is it slow: the straggler). */
export const SLOW_VERDICT_EVERY_MS = 30_000;
const VERDICT_STATES = ['stalled', 'dead'];

/** Whether the panel asks why the job is stuck: a rank is stalled or dead. */
export function needsVerdict(nodes: INodes): boolean {
  return nodes.members.some(m => VERDICT_STATES.includes(m.state));
}

/** Why the verdict names `rank` a straggler, in one word (its category, from the finding's
 * sentence), with the sentence itself; null when it does not. */
export function stragglerWhy(verdict: IVerdict | null, rank: number): { word: string; detail: string } | null {
  const found = verdict?.findings.find(f => f.kind === 'straggler' && f.ranks.includes(rank));
  if (!found) {
    return null;
  }
  const d = found.detail;
  const contended = d.includes('for the CPU time of the others') || /straggler[s]?[^:]*: its main thread waits/.test(d);
  const word = d.includes('garbage collection')
    ? 'GC'
    : d.includes('waiting for data')
      ? 'data'
      : contended
        ? 'host'
        : /takes|computes/.test(d)
          ? 'compute'
          : 'slow';
  return { word, detail: d };
}

/** How a job is worded: running, ended (waiting for a relaunch), or ended and read from its dumps. */
export type JobKind = 'running' | 'ended' | 'dumps';

export function jobKind(job: IJob): JobKind {
  if (job.source === 'dump') {
    return 'dumps';
  }
  return job.alive === false ? 'ended' : 'running';
}

/** The states every summary lists (0 included), in this order; others follow as met. */
export const STATES = ['alive', 'stalled', 'dead'];

/** One rank as the panel shows it. The server's membership view decides the bar, `slow` and the age text. */
export interface IRankRow {
  rank: number;
  /** The state's word, shown beside its colour. */
  state: string;
  role: string;
  step: string;
  /** Last seen, as the server words it ("0.4 s", "3 min"); "—" before the first report. */
  seen: string;
  /** The step-time bar's width in percent (the median fills half). */
  barPercent: number;
  slow: boolean;
  /** Milliseconds per step, "210" (the column says the unit), or "" before the first step. */
  ms: string;
  /** "1.62x the median", or "". */
  ratio: string;
  suspect: boolean;
  /** The row's tooltip: why it is in its state, or where it runs. */
  detail: string;
}

export interface INodeGroup {
  node: number;
  host: string;
  ranks: IRankRow[];
}

/** What the panel renders of a `nodes` answer: ranks grouped by node, nodes and ranks in order. */
export function rankGroups(nodes: INodes): INodeGroup[] {
  const suspects = new Set(nodes.suspects.flatMap(s => s.ranks));
  const groups = new Map<number, INodeGroup>();
  for (const m of [...nodes.members].sort((a, b) => a.rank - b.rank)) {
    let group = groups.get(m.node);
    if (group === undefined) {
      group = { node: m.node, host: m.host, ranks: [] };
      groups.set(m.node, group);
    }
    group.ranks.push({
      rank: m.rank,
      state: m.state,
      role: m.role ?? '',
      step: m.step === null ? '—' : String(m.step),
      seen: m.age ?? '—',
      barPercent: m.bar === null || m.bar === undefined ? 0 : 100 * Math.min(1, Math.max(0, m.bar)),
      slow: m.slow === true,
      ms: m.step_time_ms === null ? '' : m.step_time_ms.toFixed(0),
      ratio: m.ratio === null || m.ratio === undefined ? '' : `${m.ratio.toFixed(2)}x the median`,
      suspect: suspects.has(m.rank),
      detail:
        (m.state_for ? `${m.state} for ${m.state_for}` : m.state) +
        (m.reason ? ` ${m.reason}` : ` · pid ${m.pid} · ${m.endpoint}`) +
        (m.level === null || m.level === undefined
          ? ''
          : ` · level ${m.level}` + (m.parent === null || m.parent === undefined ? '' : ` under rank ${m.parent}`))
    });
  }
  return [...groups.values()].sort((a, b) => a.node - b.node);
}

/** Members per state: the usual states first (also when 0), then any other met. */
export function stateCounts(nodes: INodes): [string, number][] {
  const counts = new Map<string, number>(STATES.map(s => [s, 0]));
  for (const m of nodes.members) {
    counts.set(m.state, (counts.get(m.state) ?? 0) + 1);
  }
  return [...counts.entries()];
}

export interface IClusterModelOptions {
  /** Seconds between polls while visible (the settings change it later). */
  intervalSeconds?: number;
  /** The server's routes; the real ones unless given. */
  api?: ProbingApi;
  /** How often a running profile capture is looked at (ms). */
  profilePollMs?: number;
}

export class ClusterModel {
  constructor(options: IClusterModelOptions = {}) {
    const intervalSeconds = options.intervalSeconds ?? 2;
    this._api = options.api ?? api;
    this.profile = new ProfileModel(this._api, { pollMs: options.profilePollMs });
    this.profile.changed.connect(() => this._changed.emit());
    this._poll = new Poll({
      auto: false,
      factory: () => this._tick(),
      name: 'probing-magics:cluster',
      standby: () => (this._visible ? 'when-hidden' : true)
    });
    this.intervalSeconds = intervalSeconds; // set here: the constructor raises any max below 30 s to 30 s
  }

  /** The shown job's profile captures (none for a job that ended). */
  readonly profile: ProfileModel;

  /** Emitted whenever anything shown changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted when the user chose another job (the plugin saves it with the layout). */
  get chosenChanged(): ISignal<this, string | null> {
    return this._chosenChanged;
  }

  get status(): Status {
    return this._status;
  }
  get message(): string {
    return this._message;
  }
  get version(): IVersion | null {
    return this._version;
  }
  get jobs(): IJob[] {
    return this._jobs;
  }
  /** The job shown: the chosen one when it is listed, else the newest. */
  get job(): IJob | null {
    return this._jobs.find(j => j.id === this._shown) ?? null;
  }
  get chosen(): string | null {
    return this._chosen;
  }
  get nodes(): INodes | null {
    return this._nodes;
  }
  get updated(): Date | null {
    return this._updated;
  }
  get selectedRank(): number | null {
    return this._selectedRank;
  }
  get stack(): IStackGroup | null {
    return this._stack;
  }
  get stackMessage(): string {
    return this._stackMessage;
  }
  /** The poll's phase and the wait before its next tick (grows while the server fails). */
  get pollState(): IPoll.State<void, void, 'standby'> {
    return this._poll.state;
  }
  /** Why the shown job is stuck, while a rank is stalled or dead (null otherwise, or not yet known). */
  get verdict(): IVerdict | null {
    return this._verdict;
  }
  /** "job X restarted: following its new launch …", shown once per relaunch until dismissed. */
  get notice(): string {
    return this._notice;
  }

  dismissNotice(): void {
    this._notice = '';
    this._changed.emit();
  }

  set intervalSeconds(seconds: number) {
    const interval = Math.max(0.5, seconds) * 1000;
    // backoff waits up to 15 s, or one interval when that is longer (the poll refuses an interval over its max)
    this._poll.frequency = { interval, backoff: BACKOFF_FACTOR, max: Math.max(MAX_BACKOFF_MS, interval) };
  }

  /** Whether the panel is on screen; hidden, the poll stands by. */
  set visible(value: boolean) {
    this._visible = value;
    if (value && this._started) {
      void this._poll.refresh();
    }
  }

  start(chosen: string | null = null): void {
    this._chosen = chosen;
    this._started = true;
    void this._poll.start();
  }

  /** Poll now; resolves once that poll step ran (or stood by, while hidden). */
  async refresh(): Promise<void> {
    await this._poll.refresh();
    await this._poll.tick.catch(() => undefined); // it rejects only when the model is disposed meanwhile
  }

  choose(jobId: string | null): void {
    if (jobId === this._chosen) {
      return;
    }
    this._chosen = jobId;
    this._choice++;
    this._chosenChanged.emit(jobId);
    this._forgetJob();
    this._changed.emit(); // the previous job's ranks must not stay shown under the new choice
    // a tick now, also while one runs: that one asked for the job left, and its answer is dropped
    void this._poll.schedule({ interval: Poll.IMMEDIATE, phase: 'refreshed' });
  }

  async addJob(target: string, token: string): Promise<IJob> {
    const job = await this._api.addJob(target, token);
    this.choose(job.id);
    return job;
  }

  async removeJob(jobId: string): Promise<void> {
    await this._api.removeJob(jobId);
    if (this._chosen === jobId) {
      this.choose(null);
    }
    await this.refresh();
  }

  /** Show the current stack of one rank (null: close it). */
  async selectRank(rank: number | null): Promise<void> {
    const asked = ++this._stackAsked; // only the reply to the latest question, for its job and rank, is shown
    this._selectedRank = rank;
    this._stack = null;
    this._stackMessage = rank === null ? '' : `loading the stack of rank ${rank}…`;
    this._changed.emit();
    const job = this.job;
    if (rank === null || job === null) {
      return;
    }
    const current = () => asked === this._stackAsked && this._selectedRank === rank && this.job?.id === job.id;
    try {
      const reply = await this._api.stacks(job.id, String(rank));
      if (!current()) {
        return;
      }
      this._stack = reply.ranks[String(rank)] ?? null;
      this._stackMessage = this._stack ? '' : `rank ${rank} did not answer (${reply.footer})`;
    } catch (error) {
      if (!current()) {
        return;
      }
      this._stack = null;
      this._stackMessage = error instanceof Error ? error.message : String(error);
    }
    this._changed.emit();
  }

  dispose(): void {
    this._poll.dispose();
    this.profile.dispose();
    Signal.clearData(this);
  }

  private async _tick(): Promise<void> {
    const choice = this._choice; // a tick that outlives a change of job must not show the old one
    try {
      if (this._version === null) {
        const version = await this._api.version();
        if (version.api !== API_VERSION) {
          this._set(
            'no-extension',
            `the server extension is of another version (API ${version.api}, package ${version.package}); ` +
              `this panel needs API ${API_VERSION}: install the same probing-magics in the server's environment`
          );
          throw new Error('server extension version mismatch');
        }
        this._version = version;
      }
      const { jobs } = await this._api.jobs();
      if (choice !== this._choice) {
        return;
      }
      this._jobs = jobs;
      for (const j of jobs) {
        const seen = this._restartsSeen.get(j.id);
        if (seen === undefined || (j.restarts ?? 0) < seen) {
          // met for the first time (or forgotten by the server meanwhile): a relaunch from now on is news
          this._restartsSeen.set(j.id, j.restarts ?? 0);
        }
      }
      // an ended job stays shown (waiting for its relaunch) even when another job runs
      const job =
        jobs.find(j => j.id === this._chosen) ??
        jobs.find(j => j.id === this._shown && j.alive === false) ??
        jobs[0] ??
        null;
      if (job === null) {
        this._forgetJob();
        this._set('no-job', 'No job found. Start one on the server’s machine with PROBING=1, or add one by address.');
        return;
      }
      if (job.id !== this._shown) {
        this._forgetJob();
        this._shown = job.id;
      }
      void this.profile.show(jobKind(job) === 'running' ? job.id : null);
      try {
        const nodes = await this._api.nodes(job.id);
        if (choice !== this._choice) {
          return;
        }
        const seen = this._restartsSeen.get(job.id) ?? nodes.restarts;
        if (nodes.restarts > seen && nodes.restart_notice) {
          this._notice = nodes.restart_notice; // said once: the count only grows
        }
        this._restartsSeen.set(job.id, nodes.restarts);
        this._nodes = nodes;
        this._updated = new Date();
        this._set('ready', '');
        this._askVerdict(job, nodes);
      } catch (error) {
        if (choice !== this._choice) {
          return;
        }
        if (error instanceof ApiError && error.jobEnded) {
          this._nodes = null;
          this._set('job-ended', `${error.message}; waiting for a relaunch (same run id)`);
          return;
        }
        if (error instanceof ApiError && (error.jobUnreachable || error.code === 'unknown_job')) {
          this._nodes = null;
          this._set('job-unreachable', `Job ${job.run_id ?? job.id} unreachable: ${error.message}`);
          return; // the server is fine: keep the normal interval
        }
        throw error;
      }
    } catch (error) {
      if (error instanceof ServerGone) {
        this._version = null; // it may come back upgraded: check again
        this._set('server-gone', 'The Jupyter server does not answer; polling paused until it is back.');
      } else if (error instanceof ApiError && error.routeMissing) {
        this._version = null;
        this._set(
          'no-extension',
          'The probing server extension is missing from this Jupyter server (or of another version): ' +
            'install probing-magics in its environment and restart it.'
        );
      } else if (!(this._status === 'no-extension')) {
        this._set('error', error instanceof Error ? error.message : String(error));
      }
      throw error; // the poll backs off
    }
  }

  /** Beside the poll (a verdict takes a few queries): never delays the membership's refresh.
   * An ended job's dumps do not change: their verdict is asked once. */
  private _askVerdict(job: IJob, nodes: INodes): void {
    const dumps = jobKind(job) === 'dumps';
    const stuck = needsVerdict(nodes);
    if (!dumps && !stuck && this._verdictStuck) {
      // every rank alive again: the hang verdict is over; why it is slow is asked anew
      this._verdictStuck = false;
      this._verdictDue = 0;
      if (this._verdict !== null) {
        this._verdict = null;
        this._changed.emit();
      }
    }
    if (stuck && !this._verdictStuck) {
      this._verdictStuck = true;
      this._verdictDue = 0; // a rank just stalled or died: asked now
    }
    if (this._verdictAsking || Date.now() < this._verdictDue) {
      return;
    }
    const jobId = job.id;
    this._verdictAsking = true;
    this._verdictDue = dumps ? Infinity : Date.now() + (stuck ? VERDICT_EVERY_MS : SLOW_VERDICT_EVERY_MS);
    const asked = this._verdictAsked;
    this._api
      .diagnose(jobId)
      .then(verdict => {
        if (asked === this._verdictAsked && this._shown === jobId) {
          this._verdict = verdict;
          this._changed.emit();
        }
      })
      .catch(() => {
        if (asked === this._verdictAsked) {
          this._verdictDue = Date.now() + VERDICT_EVERY_MS; // asked again then; the membership shows what is known
        }
      })
      .finally(() => {
        if (asked === this._verdictAsked) {
          this._verdictAsking = false;
        }
      });
  }

  private _forgetJob(): void {
    void this.profile.show(null); // a capture's answer belongs to its job
    this._verdictAsked++; // a verdict still on its way belongs to the job left
    this._verdictAsking = false;
    this._verdictDue = 0;
    this._verdictStuck = false;
    this._verdict = null;
    this._stackAsked++; // a stack still on its way belongs to the job left
    this._shown = null;
    this._nodes = null;
    this._updated = null;
    this._selectedRank = null;
    this._stack = null;
    this._stackMessage = '';
    this._notice = '';
  }

  private _set(status: Status, message: string): void {
    this._status = status;
    this._message = message;
    this._changed.emit();
  }

  private readonly _api: ProbingApi;
  private _poll: Poll;
  private _changed = new Signal<this, void>(this);
  private _chosenChanged = new Signal<this, string | null>(this);
  private _status: Status = 'starting';
  private _message = 'Connecting to the server extension…';
  private _version: IVersion | null = null;
  private _jobs: IJob[] = [];
  private _chosen: string | null = null;
  private _choice = 0;
  private _shown: string | null = null;
  private _nodes: INodes | null = null;
  private _updated: Date | null = null;
  private _selectedRank: number | null = null;
  private _stack: IStackGroup | null = null;
  private _stackMessage = '';
  private _stackAsked = 0;
  private _notice = '';
  private _verdict: IVerdict | null = null;
  private _verdictAsked = 0;
  private _verdictAsking = false;
  private _verdictDue = 0;
  private _verdictStuck = false; // the last verdict asked was for a stalled or dead rank
  private _restartsSeen = new Map<string, number>();
  private _visible = false;
  private _started = false;
}
